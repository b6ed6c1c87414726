"""The JavaScript context driver: node's ``vm`` module, one persistent context.

The same frames as the Python driver (``pydriver``: a 4-byte big-endian
length, then a JSON object; commands on fd 0, events on fd 1), written to the
context's job directory as ``driver.js`` and run by the jail's ``node``. It is
kept here as a string so it ships inside the Python package like the rest of
the runner.

Each cell is a ``vm.Script`` run in one context, so ``var``/``let`` bindings and
functions persist; the script's completion value (the last expression
statement's) is the main result, shown by ``util.inspect`` as ``text/plain``.
``console.log`` and friends write ``stdout``/``stderr`` frames in order. The
driver is synchronous (it blocks reading its next command), so timers a cell
schedules do not run between cells. SIGINT interrupts a running cell
(``breakOnSigint``) and is otherwise ignored, so the interpreter survives it.
"""

from __future__ import annotations

NODE_DRIVER = r"""
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');

const CMD = 0;
const EVT = 1;
const PAUSE = new Int32Array(new SharedArrayBuffer(4));
let count = 0;

function send(message) {
  const body = Buffer.from(JSON.stringify(message), 'utf8');
  const head = Buffer.alloc(4);
  head.writeUInt32BE(body.length, 0);
  const frame = Buffer.concat([head, body]);
  let off = 0;
  while (off < frame.length) {
    try {
      off += fs.writeSync(EVT, frame, off, frame.length - off);
    } catch (err) {
      if (err.code !== 'EAGAIN') throw err;
    }
  }
}

function readExact(size) {
  const buf = Buffer.alloc(size);
  let off = 0;
  while (off < size) {
    let n;
    try {
      n = fs.readSync(CMD, buf, off, size - off, null);
    } catch (err) {
      if (err.code === 'EAGAIN' || err.code === 'EINTR') {
        Atomics.wait(PAUSE, 0, 0, 2);  // a non-blocking descriptor: wait, do not spin
        continue;
      }
      if (err.code === 'EOF') return null;
      throw err;
    }
    if (n === 0) return null;
    off += n;
  }
  return buf;
}

function receive() {
  const head = readExact(4);
  if (head === null) return null;
  const body = readExact(head.readUInt32BE(0));
  if (body === null) return null;
  return JSON.parse(body.toString('utf8'));
}

function text(args) {
  return util.format(...args) + '\n';
}

const sandboxConsole = {
  log: (...a) => send({t: 'stdout', data: text(a)}),
  info: (...a) => send({t: 'stdout', data: text(a)}),
  debug: (...a) => send({t: 'stdout', data: text(a)}),
  warn: (...a) => send({t: 'stderr', data: text(a)}),
  error: (...a) => send({t: 'stderr', data: text(a)}),
  dir: (v) => send({t: 'stdout', data: util.inspect(v) + '\n'}),
  table: (v) => send({t: 'stdout', data: util.inspect(v) + '\n'}),
};

function display(value) {
  send({t: 'result', data: bundle(value), main: false});
}

function bundle(value) {
  const data = {'text/plain': util.inspect(value, {depth: 4, maxArrayLength: 200})};
  if (value && typeof value === 'object') {
    const reprs = [['_repr_html_', 'text/html'], ['_repr_markdown_', 'text/markdown'],
                   ['_repr_svg_', 'image/svg+xml'], ['_repr_png_', 'image/png']];
    for (const [method, mime] of reprs) {
      try {
        if (typeof value[method] === 'function') {
          const item = value[method]();
          if (typeof item === 'string') data[mime] = item;
        }
      } catch (err) { /* a broken representation must not break the cell */ }
    }
  }
  return data;
}

const context = vm.createContext({
  console: sandboxConsole, display, require,
  process: {env: process.env, argv: [], cwd: () => process.cwd()},
  Buffer, setTimeout, setInterval, clearTimeout, clearInterval, URL, TextEncoder, TextDecoder,
});

// The driver's own frames (vm, this file, node's loader) are not the user's business.
function userStack(stack) {
  return stack.split('\n').filter((line) => !/node:vm|driver\.js|node:internal/.test(line))
    .join('\n') + '\n';
}

function run(code, env) {
  count += 1;
  const saved = {};
  for (const [k, v] of Object.entries(env)) { saved[k] = process.env[k]; process.env[k] = v; }
  const started = process.cpuUsage();
  let status = 'ok';
  try {
    const script = new vm.Script(code, {filename: `<cell-${count}>`});
    const value = script.runInContext(context, {breakOnSigint: true, displayErrors: false});
    if (value !== undefined) send({t: 'result', data: bundle(value), main: true});
  } catch (err) {
    status = 'error';
    const isError = err instanceof Error || (err && typeof err.stack === 'string');
    const interrupted = isError && /Script execution (was )?interrupted/.test(String(err.message));
    send({
      t: 'error',
      name: interrupted ? 'KeyboardInterrupt' : (isError && err.name) || typeof err,
      value: isError ? String(err.message) : util.inspect(err),
      traceback: isError ? userStack(String(err.stack)) : util.inspect(err),
    });
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k]; else process.env[k] = v;
    }
  }
  const used = process.cpuUsage(started);
  send({t: 'end', status, count, cpu_ms: Math.round((used.user + used.system) / 1000)});
}

process.on('SIGINT', () => {});  // between cells an interrupt interrupts nothing
process.chdir(process.argv[2] || process.cwd());
send({t: 'ready', version: 'node ' + process.versions.node});
for (;;) {
  const message = receive();
  if (message === null) break;
  if (message.op === 'run') run(String(message.code || ''), message.env || {});
  // After a timeout: end what the cell left running; as PID 1 of the jail, kill(-1)
  // reaches that pid namespace only (never unjailed, where it would reach the user's).
  if (message.op === 'reap' && process.pid === 1) {
    try { process.kill(-1, 'SIGKILL'); } catch (err) { /* nothing left */ }
  }
}
process.exit(0);
"""

__all__ = ["NODE_DRIVER"]
