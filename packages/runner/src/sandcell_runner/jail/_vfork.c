/* The spawn helper's vfork path: the whole child set-up of ``spawnd_job.child`` in C.
 *
 * Why this exists (issue 21). The helper (``spawnd.py``) used to ``os.fork()`` itself
 * for every jailed process: the fork copies the page tables of a ~12 MiB Python, the
 * child then takes copy-on-write faults while its Python runs the set-up, and its exec
 * tears that copy down again. A ``vfork()`` child shares the helper's memory until it
 * execs, so none of that happens. Python cannot run in a vfork child (its allocator,
 * its signal handlers and glibc's setxid broadcast would touch the parent's state), so
 * the set-up is here, in async-signal-safe calls only, following the rules of CPython's
 * own ``Modules/_posixsubprocess.c``:
 *   - every Python argument is turned into C arrays BEFORE vfork;
 *   - all signals are blocked around vfork; the child resets every signal with a
 *     handler to SIG_DFL (a handler would run the parent's code on the parent's
 *     memory), and every ignored one too (Python ignores SIGPIPE and SIGXFSZ, a
 *     launcher may leave others, and an ignored disposition survives exec), then
 *     restores the mask;
 *   - the UID/GID switch uses raw ``syscall(SYS_setres[ug]id, SYS_setgroups)``: glibc's
 *     wrappers broadcast the change to every thread of the process (the parent's
 *     thread list, in a child that shares its memory);
 *   - the child never returns from the function that called vfork: it execs or
 *     ``_exit``s. A failed step is written into memory shared with the parent (the
 *     ``struct report`` on the parent's stack, CLONE_VM) before ``_exit(127)``, as
 *     glibc's posix_spawn does; vfork returns in the parent only after the child's
 *     exec or exit, so the parent knows the outcome synchronously.
 *
 * The kill guarantee is unchanged: the child sets PR_SET_PDEATHSIG (SIGKILL) after
 * the UID switch (which clears it) and checks that its parent is still the helper.
 * The parent of a vfork child is the process that called vfork, as with fork.
 *
 * Measured (scripts/bench_spawn.py: 500 spawns of /bin/true straight to the helper,
 * 6 alternating pairs, 2 shared cores at load 2.1-2.9, 2026-12-03 08:52 UTC, commit
 * 85776e2): helper CPU per spawn 1.16 ms (fork) -> 0.30 ms (vfork), its children's
 * 2.42 -> 0.86 ms (medians); 2.29-2.76 CPU-ms less per spawn in every pair. Through
 * the runner (bench_breakdown.py --b-tree main 1ceb787, 3 rounds, load 1-2.3): the
 * tree's CPU per `bash: true` 19.6 -> 18.3 ms (helper 1.40 -> 0.60).
 */
/* The stable ABI (3.11 and later): one build serves every Python the runner runs on, so
 * scripts/build-runner-image builds it on the host (which has a compiler) for an image
 * whose Python is another minor version (and has none). */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_NEWNET
#define CLONE_NEWNET 0x40000000
#endif

/* 32-bit x86 and ARM name the 32-bit-ID calls apart; elsewhere they are the only ones. */
#ifdef SYS_setresuid32
#define SANDCELL_SYS_SETRESUID SYS_setresuid32
#define SANDCELL_SYS_SETRESGID SYS_setresgid32
#define SANDCELL_SYS_SETGROUPS SYS_setgroups32
#else
#define SANDCELL_SYS_SETRESUID SYS_setresuid
#define SANDCELL_SYS_SETRESGID SYS_setresgid
#define SANDCELL_SYS_SETGROUPS SYS_setgroups
#endif

/* The step names of ``spawnd_job.child`` (the runner's error messages carry them). */
enum step {
    STEP_NONE = 0,
    STEP_SETUP,
    STEP_SETSID,
    STEP_SETNS,
    STEP_CGROUP,
    STEP_CHDIR,
    STEP_FDS,
    STEP_SETUID,
    STEP_PDEATHSIG,
    STEP_EXEC,
    STEP_FORK,
};

static const char *const step_names[] = {
    "", "setup", "setsid", "setns", "cgroup", "chdir", "fds", "setuid", "pdeathsig", "exec",
    "fork",
};

/* Written by the child (shared memory) when a step fails; read by the parent after vfork. */
struct report {
    volatile int step;
    volatile int error;
    volatile Py_ssize_t index; /* which join path failed, for the message */
};

/* Everything the child needs, as plain C. */
struct job {
    char *const *argv;
    char *const *envp;
    const int *fds;
    Py_ssize_t fd_count;
    int *high; /* scratch, fd_count entries: the sources dup'd above every target */
    const int *targets;
    Py_ssize_t target_count;
    const char *const *join_paths;
    Py_ssize_t join_path_count;
    const int *join_fds;
    Py_ssize_t join_fd_count;
    int netns_fd;    /* -1: stay in ours */
    const char *cwd; /* NULL: stay */
    long uid;        /* -1: stay */
    long gid;
    int setsid;
    pid_t parent;
    const sigset_t *old_mask;
};

static _Noreturn void
child_failed(struct report *report, enum step step, int error)
{
    report->step = (int)step;
    report->error = error;
    _exit(127);
}

/* In the vfork child: async-signal-safe calls only, and never a return. Not inlined:
   its locals live in a frame of its own, below the one vfork returned into. */
__attribute__((noinline)) static _Noreturn void
child_exec(const struct job *job, struct report *report)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction now;
        if (sig == SIGKILL || sig == SIGSTOP) {
            continue;
        }
        /* glibc refuses its internal signals (EINVAL): nothing to reset there. */
        if (sigaction(sig, NULL, &now) != 0) {
            continue;
        }
        /* Handled or ignored alike: an ignored disposition survives exec, and no job
           starts with one (Python's SIGPIPE and SIGXFSZ, or a launcher's nohup).
           (A SA_SIGINFO handler is always a function.) */
        if ((now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL) {
            (void)sigaction(sig, &dfl, NULL);
        }
    }
    if (sigprocmask(SIG_SETMASK, job->old_mask, NULL) != 0) {
        child_failed(report, STEP_SETUP, errno);
    }

    if (job->setsid && setsid() < 0) {
        child_failed(report, STEP_SETSID, errno);
    }
    if (job->netns_fd >= 0 && syscall(SYS_setns, job->netns_fd, CLONE_NEWNET) != 0) {
        child_failed(report, STEP_SETNS, errno);
    }
    for (Py_ssize_t i = 0; i < job->join_path_count; i++) {
        int fd = open(job->join_paths[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) {
            report->index = i;
            child_failed(report, STEP_CGROUP, errno);
        }
        (void)close(fd);
    }
    for (Py_ssize_t i = 0; i < job->join_fd_count; i++) {
        if (write(job->join_fds[i], "0", 1) != 1) {
            report->index = -1;
            child_failed(report, STEP_CGROUP, errno);
        }
    }
    if (job->cwd != NULL && chdir(job->cwd) != 0) {
        child_failed(report, STEP_CHDIR, errno);
    }

    /* Descriptors go to the numbers the runner gave them (its argv names them):
       every source first above every target, so no dup2 clobbers a source. */
    int base = 2;
    for (Py_ssize_t i = 0; i < job->target_count; i++) {
        if (job->targets[i] > base) {
            base = job->targets[i];
        }
    }
    for (Py_ssize_t i = 0; i < job->fd_count; i++) {
        if (job->fds[i] > base) {
            base = job->fds[i];
        }
    }
    base += 1;
    for (Py_ssize_t i = 0; i < job->target_count; i++) {
        job->high[i] = fcntl(job->fds[i], F_DUPFD_CLOEXEC, base);
        if (job->high[i] < 0) {
            child_failed(report, STEP_FDS, errno);
        }
    }
    for (Py_ssize_t i = 0; i < job->target_count; i++) {
        /* dup2 leaves the target without FD_CLOEXEC: it is inherited by the exec. */
        if (dup2(job->high[i], job->targets[i]) < 0) {
            child_failed(report, STEP_FDS, errno);
        }
    }

    if (job->uid >= 0 && job->gid >= 0) {
        /* Raw system calls: this task alone, no glibc broadcast to "its" threads. */
        if (syscall(SANDCELL_SYS_SETGROUPS, 0, NULL) != 0 ||
            syscall(SANDCELL_SYS_SETRESGID, job->gid, job->gid, job->gid) != 0 ||
            syscall(SANDCELL_SYS_SETRESUID, job->uid, job->uid, job->uid) != 0) {
            child_failed(report, STEP_SETUID, errno);
        }
    }
    /* After the UID switch, which clears it; then make sure the helper did not die
       before it was set (the signal would never come). */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
        child_failed(report, STEP_PDEATHSIG, errno);
    }
    if (getppid() != job->parent) {
        _exit(126);
    }
    execve(job->argv[0], job->argv, job->envp);
    child_failed(report, STEP_EXEC, errno);
}

/* vfork, and the child's set-up; in the parent, the child's pid (-1: errno) once it
   has exec'd or exited. A function of its own (as CPython's do_fork_exec) so that the
   frame the child shares with the parent until exec is this small one. */
__attribute__((noinline)) static pid_t
do_vfork(const struct job *job, struct report *report)
{
    /* The child writes *report on a path that never returns here, which lets the
       compiler prove the parent's later reads unchanged: a first version, with all
       of this inline in vfork_spawn, had GCC 12 -O2 drop them (volatile or not), so
       every failed step read as success. The functions are kept apart and the report
       escapes to memory before the call and is read afresh after it. */
    __asm__ __volatile__("" : : "r"(report) : "memory");
    pid_t pid = vfork();
    if (pid == 0) {
        child_exec(job, report);
    }
    __asm__ __volatile__("" : : "r"(report) : "memory");
    return pid;
}

/* A NULL-terminated array of the bytes objects in ``list`` (borrowed pointers: the
   list must outlive it). NULL with an exception set on a bad item. */
static char **
bytes_array(PyObject *list, const char *what)
{
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of bytes", what);
        return NULL;
    }
    Py_ssize_t count = PyList_Size(list);
    char **array = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    if (array == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GetItem(list, i);
        char *data;
        Py_ssize_t size;
        if (!PyBytes_Check(item) || PyBytes_AsStringAndSize(item, &data, &size) != 0) {
            PyErr_Format(PyExc_TypeError, "%s must be a list of bytes", what);
            PyMem_Free(array);
            return NULL;
        }
        if ((Py_ssize_t)strlen(data) != size) {
            PyErr_Format(PyExc_ValueError, "embedded null byte in %s", what);
            PyMem_Free(array);
            return NULL;
        }
        array[i] = data;
    }
    return array;
}

/* The ints of ``list`` as a C array of ``count`` (at least one element allocated). */
static int *
int_array(PyObject *list, const char *what, Py_ssize_t *count)
{
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of int", what);
        return NULL;
    }
    *count = PyList_Size(list);
    int *array = PyMem_Calloc((size_t)*count + 1, sizeof(int));
    if (array == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        long value = PyLong_AsLong(PyList_GetItem(list, i));
        if (value == -1 && PyErr_Occurred()) {
            PyMem_Free(array);
            return NULL;
        }
        if (value < 0 || value > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: descriptor out of range", what);
            PyMem_Free(array);
            return NULL;
        }
        array[i] = (int)value;
    }
    return array;
}

PyDoc_STRVAR(spawn_doc,
             "spawn(argv, envp, fds, targets, join_paths, join_fds, netns_fd, cwd, uid, gid,\n"
             "      setsid, parent) -> (pid, step, errno, index)\n\n"
             "vfork, set up as spawnd_job.child does, and exec. (pid, '', 0, -1) once the child\n"
             "exec'd; (0, step, errno, index) when a step failed (the child is reaped).");

static PyObject *
vfork_spawn(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *argv_list, *envp_list, *fds_list, *targets_list, *paths_list, *join_fds_list;
    PyObject *cwd_obj;
    int netns_fd, setsid_flag, parent;
    long uid, gid;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!iOllpi:spawn", &PyList_Type, &argv_list,
                          &PyList_Type, &envp_list, &PyList_Type, &fds_list, &PyList_Type,
                          &targets_list, &PyList_Type, &paths_list, &PyList_Type,
                          &join_fds_list, &netns_fd, &cwd_obj, &uid, &gid, &setsid_flag,
                          &parent)) {
        return NULL;
    }
    if (cwd_obj != Py_None && !PyBytes_Check(cwd_obj)) {
        PyErr_SetString(PyExc_TypeError, "cwd must be bytes or None");
        return NULL;
    }
    /* -1: none; otherwise a 32-bit ID other than (uid_t)-1 (which means "leave it"). */
    if (uid < -1 || uid >= 0xFFFFFFFFL || gid < -1 || gid >= 0xFFFFFFFFL) {
        PyErr_SetString(PyExc_ValueError, "uid or gid out of range");
        return NULL;
    }
    if (PyList_Size(argv_list) == 0) {
        PyErr_SetString(PyExc_ValueError, "argv must not be empty");
        return NULL;
    }

    PyObject *result = NULL;
    char **argv = NULL, **envp = NULL, **join_paths = NULL;
    int *fds = NULL, *targets = NULL, *join_fds = NULL, *high = NULL;
    Py_ssize_t fd_count = 0, target_count = 0, join_fd_count = 0;
    const char *cwd = NULL;

    if ((argv = bytes_array(argv_list, "argv")) == NULL ||
        (envp = bytes_array(envp_list, "envp")) == NULL ||
        (join_paths = bytes_array(paths_list, "join_paths")) == NULL ||
        (fds = int_array(fds_list, "fds", &fd_count)) == NULL ||
        (targets = int_array(targets_list, "targets", &target_count)) == NULL ||
        (join_fds = int_array(join_fds_list, "join_fds", &join_fd_count)) == NULL) {
        goto done;
    }
    if (target_count > fd_count) {
        PyErr_SetString(PyExc_ValueError, "more targets than descriptors");
        goto done;
    }
    if (cwd_obj != Py_None) {
        cwd = PyBytes_AsString(cwd_obj);
        if ((Py_ssize_t)strlen(cwd) != PyBytes_Size(cwd_obj)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte in cwd");
            goto done;
        }
    }
    high = PyMem_Calloc((size_t)target_count + 1, sizeof(int));
    if (high == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    sigset_t all, old_mask;
    sigfillset(&all);
    struct report report = {.step = STEP_NONE, .error = 0, .index = -1};
    struct job job = {
        .argv = argv,
        .envp = envp,
        .fds = fds,
        .fd_count = fd_count,
        .high = high,
        .targets = targets,
        .target_count = target_count,
        .join_paths = (const char *const *)join_paths,
        .join_path_count = PyList_Size(paths_list),
        .join_fds = join_fds,
        .join_fd_count = join_fd_count,
        .netns_fd = netns_fd,
        .cwd = cwd,
        .uid = uid,
        .gid = gid,
        .setsid = setsid_flag,
        .parent = (pid_t)parent,
        .old_mask = &old_mask,
    };
    int mask_error = pthread_sigmask(SIG_BLOCK, &all, &old_mask);
    if (mask_error != 0) {
        errno = mask_error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    pid_t pid = do_vfork(&job, &report);
    int vfork_errno = errno;
    (void)pthread_sigmask(SIG_SETMASK, &old_mask, NULL);

    if (pid < 0) {
        result = Py_BuildValue("(isin)", 0, step_names[STEP_FORK], vfork_errno, (Py_ssize_t)-1);
    }
    else if (report.step != STEP_NONE) {
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        int step = report.step;
        if (step < 0 || step >= (int)(sizeof step_names / sizeof step_names[0])) {
            step = STEP_SETUP;
        }
        result = Py_BuildValue("(isin)", 0, step_names[step], (int)report.error,
                               (Py_ssize_t)report.index);
    }
    else {
        result = Py_BuildValue("(isin)", (int)pid, "", 0, (Py_ssize_t)-1);
    }

done:
    PyMem_Free(argv);
    PyMem_Free(envp);
    PyMem_Free(join_paths);
    PyMem_Free(fds);
    PyMem_Free(targets);
    PyMem_Free(join_fds);
    PyMem_Free(high);
    return result;
}

static PyMethodDef vfork_methods[] = {
    {"spawn", vfork_spawn, METH_VARARGS, spawn_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef vfork_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_vfork",
    .m_doc = "The spawn helper's vfork path (see spawnd.py; optional: the fork path remains).",
    .m_size = 0,
    .m_methods = vfork_methods,
};

PyMODINIT_FUNC
PyInit__vfork(void)
{
    return PyModuleDef_Init(&vfork_module);
}
