// Drives LibreChat's own client (@librechat/agents, two pinned versions) for the
// tests in this folder: one JSON request per stdin line, one JSON answer per
// stdout line. The tools are invoked without a model, as LibreChat's ToolNode does:
// tool.invoke({name, id, type: 'tool_call', args, session_id?, _injected_files?}).
//
// Request: {id, version: "current"|"legacy", tool: "code"|"bash"|"ptc"|"bashptc"|"normalize"|"normalize_bash", params, call}
//   (call.ptc_tools: names from PTC_TOOLS to hand the programmatic tool)
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

// Tools the programmatic tool calls (tool: "ptc") may use, built as LibreChat's are:
// LangChain tools with JSON schemas, handed over in the tool call's toolMap/toolDefs.
const PTC_TOOLS = {
  get_weather: {
    description: 'The weather in a city',
    schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    run: async ({ city }) => JSON.stringify({ city, temp_c: city.length * 3 }),
  },
  'add-numbers': {
    description: 'Adds two numbers',
    schema: { type: 'object', properties: { a: { type: 'number' }, b: { type: 'number' } } },
    run: async ({ a, b }) => String(a + b),
  },
  fail: {
    description: 'Always fails',
    schema: { type: 'object', properties: {} },
    run: async () => {
      throw new Error('the tool broke');
    },
  },
};

// Any other name: a tool that answers with its name and the ``n`` it was given (the
// bash tests name tools like the commands a shell uses).
function echoTool(name) {
  return {
    description: 'Answers with its own name and the n it was given',
    schema: { type: 'object', properties: { n: { type: 'string' } } },
    run: async ({ n }) => `${name} ok ${n}`,
  };
}

function ptcTools(version, names) {
  const { tool } = require(require.resolve('@langchain/core/tools', { paths: [require.resolve(packages[version])] }));
  const toolMap = new Map();
  const toolDefs = [];
  for (const name of names) {
    const spec = Object.hasOwn(PTC_TOOLS, name) ? PTC_TOOLS[name] : echoTool(name);
    toolMap.set(name, tool(spec.run, { name, description: spec.description, schema: spec.schema }));
    toolDefs.push({ name, description: spec.description, parameters: spec.schema });
  }
  return { toolMap, toolDefs };
}

const FACTORIES = {
  code: 'createCodeExecutionTool',
  bash: 'createBashExecutionTool',
  ptc: 'createProgrammaticToolCallingTool',
  bashptc: 'createBashProgrammaticToolCallingTool',
};

async function run(request) {
  const agents = load(request.version);
  if (request.tool === 'normalize') {
    // The client's own tool-name normalization, for the server's parity test.
    return { content: (request.call?.names ?? []).map((name) => agents.normalizeToPythonIdentifier(name)) };
  }
  if (request.tool === 'normalize_bash') {
    return { content: (request.call?.names ?? []).map((name) => agents.normalizeToBashIdentifier(name)) };
  }
  const factory = agents[FACTORIES[request.tool]];
  if (typeof factory !== 'function') throw new Error(`${request.version} has no ${request.tool} tool`);
  const tool = factory(request.params ?? {});
  const call = request.call ?? {};
  const extra = call.ptc_tools != null ? ptcTools(request.version, call.ptc_tools) : {};
  const message = await tool.invoke({
    name: tool.name,
    id: call.id ?? `call_${request.id}`,
    type: 'tool_call',
    args: call.args ?? {},
    ...(call.session_id != null ? { session_id: call.session_id } : {}),
    ...(call._injected_files != null ? { _injected_files: call._injected_files } : {}),
    ...(call._runtime_session_hint != null ? { _runtime_session_hint: call._runtime_session_hint } : {}),
    ...extra,
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
