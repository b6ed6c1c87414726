// Drives LibreChat's own client (@librechat/agents, two pinned versions) for the
// tests in this folder: one JSON request per stdin line, one JSON answer per
// stdout line. The tools are invoked without a model, as LibreChat's ToolNode does:
// tool.invoke({name, id, type: 'tool_call', args, session_id?, _injected_files?}).
//
// Request: {id, version: "current"|"legacy", tool: "code"|"bash", params, call}
// Answer:  {id, ok: true, content, artifact} | {id, ok: false, error}
'use strict';
const readline = require('node:readline');

const packages = { current: 'agents-current', legacy: 'agents-legacy' };
const loaded = {};

function load(version) {
  if (!(version in packages)) throw new Error(`unknown version ${version}`);
  // The legacy package reads LIBRECHAT_CODE_BASEURL once, when it is loaded.
  loaded[version] ??= require(packages[version]);
  return loaded[version];
}

async function run(request) {
  const agents = load(request.version);
  const factory = request.tool === 'bash' ? agents.createBashExecutionTool : agents.createCodeExecutionTool;
  if (typeof factory !== 'function') throw new Error(`${request.version} has no ${request.tool} tool`);
  const tool = factory(request.params ?? {});
  const call = request.call ?? {};
  const message = await tool.invoke({
    name: tool.name,
    id: call.id ?? `call_${request.id}`,
    type: 'tool_call',
    args: call.args ?? {},
    ...(call.session_id != null ? { session_id: call.session_id } : {}),
    ...(call._injected_files != null ? { _injected_files: call._injected_files } : {}),
    ...(call._runtime_session_hint != null ? { _runtime_session_hint: call._runtime_session_hint } : {}),
  });
  return { content: message.content, artifact: message.artifact ?? null, status: message.status ?? null };
}

const input = readline.createInterface({ input: process.stdin });
input.on('line', (line) => {
  let request;
  try {
    request = JSON.parse(line);
  } catch (error) {
    process.stdout.write(JSON.stringify({ id: null, ok: false, error: `bad request line: ${error}` }) + '\n');
    return;
  }
  run(request).then(
    (result) => process.stdout.write(JSON.stringify({ id: request.id, ok: true, ...result }) + '\n'),
    (error) => process.stdout.write(JSON.stringify({ id: request.id, ok: false, error: String(error?.message ?? error) }) + '\n'),
  );
});
process.stdout.write(JSON.stringify({ ready: true }) + '\n');
