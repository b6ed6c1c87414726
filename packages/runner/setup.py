"""The runner's one compiled part, optional: the spawn helper's vfork path (``jail/_vfork.c``).

Everything else is in ``pyproject.toml``. ``optional=True``: where it does not build
(no C compiler or Python headers), the package installs without it and the helper
forks in pure Python (``jail/spawnd.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sandcell_runner.jail._vfork",
            ["src/sandcell_runner/jail/_vfork.c"],
            extra_compile_args=["-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
            # Stable ABI (``Py_LIMITED_API`` in the source): the wheel
            # scripts/build-runner-image builds on the host serves the image's Python too.
            py_limited_api=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
