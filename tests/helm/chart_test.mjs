#!/usr/bin/env node
// The Helm chart, deploy/helm/tandem: `helm lint` and `helm template` with the
// default values, with every deploy/helm/tandem/ci/*-values.yaml and with TLS
// from a certificate made here; then checks on the rendered objects:
//
//   - every object validates against the Kubernetes (1.34) and Prometheus
//     Operator schemas of the kubernetes-models packages, with unknown fields
//     refused as well;
//   - every container has liveness and readiness probes on its own gRPC port
//     (native gRPC probes asking "" and "tandem.ready", or `tandem health`
//     with TLS) and resource requests;
//   - every ConfigMap, Secret, Service, PVC, volume and ServiceAccount that is
//     referenced is rendered too, or named in the values as an existing one;
//     Services and budgets select pods that are rendered, by ports they have;
//   - each daemon's command line and rendered configuration pass the daemon's
//     own loader (`--check-config`, from build/bin), and what it prints fits
//     the objects: addresses, ports, mounted files, the parameter count;
//   - the configuration keys the schema accepts plus the ones the chart sets
//     (and the few it withholds on purpose) are exactly the keys each daemon
//     reads;
//   - the dashboards and rules folders become ConfigMaps and a PrometheusRule;
// and that values.schema.json refuses every file in tests/helm/bad/ with a
// message naming the field (the file's "# expect:" lines).
//
// Usage: node tests/helm/chart_test.mjs [--source-dir DIR] [--bin-dir DIR] [--tools-dir DIR]
// helm and the Node packages come from `make deps` (scripts/deps.sh, into .tools/).
// Bounds its own time (BUDGET_MS) and starts no process that outlives it.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const BUDGET_MS = 90_000;
const CHILD_TIMEOUT_MS = 30_000;
const started = Date.now();

// --- arguments and tools -------------------------------------------------------------------

const here = path.dirname(fileURLToPath(import.meta.url));
const opts = { "source-dir": path.resolve(here, "../.."), "bin-dir": "", "tools-dir": "" };
for (let i = 2; i < process.argv.length; i += 2) {
  const key = process.argv[i].replace(/^--/, "");
  if (!(key in opts) || i + 1 >= process.argv.length) {
    console.error(`usage: chart_test.mjs [--source-dir DIR] [--bin-dir DIR] [--tools-dir DIR] (bad argument '${process.argv[i]}')`);
    process.exit(2);
  }
  opts[key] = path.resolve(process.argv[i + 1]);
}
const SOURCE = opts["source-dir"];
const BIN = opts["bin-dir"] || path.join(SOURCE, "build/bin");
const TOOLS = opts["tools-dir"] || path.join(SOURCE, ".tools");
const CHART = path.join(SOURCE, "deploy/helm/tandem");
const HELM = path.join(TOOLS, "bin/helm");
const NODE_MODULES = path.join(TOOLS, "node/node_modules");
const RELEASE = "t";
const NAMESPACE = "tandem-test";

for (const [what, p] of [["helm", HELM], ["the Node packages", NODE_MODULES], ["the daemons", path.join(BIN, "tandem-worker")]]) {
  if (!fs.existsSync(p)) {
    console.error(`chart_test: ${what} not found at ${p}: run 'make deps' (and 'make build')`);
    process.exit(1);
  }
}
// The chart links to the dashboards and rules (dashboards/, rules/); Helm refuses a chart whose links lead nowhere.
for (const link of ["dashboards", "rules"]) {
  const at = path.join(CHART, link);
  const target = fs.lstatSync(at, { throwIfNoEntry: false })?.isSymbolicLink() ? path.resolve(CHART, fs.readlinkSync(at)) : at;
  if (!fs.existsSync(target)) {
    console.error(`chart_test: ${path.relative(SOURCE, target)} (linked from the chart's ${link}/) does not exist`);
    process.exit(1);
  }
}
const YAML = await import(pathToFileURL(path.join(NODE_MODULES, "yaml/dist/index.js")).href);

const work = fs.mkdtempSync(path.join(os.tmpdir(), "tandem-chart-test-"));
process.on("exit", () => fs.rmSync(work, { recursive: true, force: true }));

// --- results -------------------------------------------------------------------------------

let passed = 0;
let failed = 0;
function report(name, problems) {
  if (problems.length === 0) {
    passed++;
    console.log(`ok      ${name}`);
  } else {
    failed++;
    console.log(`FAILED  ${name}`);
    for (const p of problems.slice(0, 40)) console.log(`          ${p}`);
    if (problems.length > 40) console.log(`          ... and ${problems.length - 40} more`);
  }
}
function overBudget() {
  return Date.now() - started > BUDGET_MS;
}

// Runs a program to completion (killed after CHILD_TIMEOUT_MS); never throws.
function run(file, args, extraEnv = {}) {
  const r = spawnSync(file, args, {
    encoding: "utf8",
    timeout: CHILD_TIMEOUT_MS,
    killSignal: "SIGKILL",
    maxBuffer: 64 << 20,
    env: { ...process.env, ...extraEnv },
  });
  const status = r.error ? `${r.error.code || r.error.message}` : r.signal ? `killed by ${r.signal}` : r.status;
  return { status, stdout: r.stdout || "", stderr: r.stderr || "" };
}
const helmEnv = {
  HELM_CACHE_HOME: path.join(work, "helm/cache"),
  HELM_CONFIG_HOME: path.join(work, "helm/config"),
  HELM_DATA_HOME: path.join(work, "helm/data"),
};
// Helm says so on stderr whenever it follows the chart's links to the dashboards and rules.
const quiet = (stderr) =>
  stderr
    .split("\n")
    .filter((l) => l.trim() && !/found symbolic link in path/.test(l))
    .join("\n");
function helm(args) {
  return run(HELM, args, helmEnv);
}

// --- Kubernetes schemas ----------------------------------------------------------------------

const GROUP_PREFIX = {
  "": "kubernetes-models/_schemas/IoK8sApiCore",
  apps: "kubernetes-models/_schemas/IoK8sApiApps",
  policy: "kubernetes-models/_schemas/IoK8sApiPolicy",
  batch: "kubernetes-models/_schemas/IoK8sApiBatch",
  "monitoring.coreos.com":
    "@kubernetes-models/prometheus-operator/_schemas/ComGithubPrometheusOperatorPrometheusOperatorPkgApisMonitoring",
};
const validators = new Map();
async function validatorFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const prefix = GROUP_PREFIX[group];
  if (!prefix) return null;
  const file = path.join(NODE_MODULES, `${prefix}${version[0].toUpperCase()}${version.slice(1)}${kind}.js`);
  if (!validators.has(file)) {
    validators.set(file, fs.existsSync(file) ? (await import(pathToFileURL(file).href)).validate : null);
  }
  return validators.get(file);
}

// Wraps an object so that validation records which keys the schema looked up.
// The generated validators look up every property their schema declares and
// enumerate maps, so a key of a looked-up object that was never read is one
// the schema does not know.
function tracked(value, where, records) {
  if (Array.isArray(value)) return value.map((v, i) => tracked(v, `${where}/${i}`, records));
  if (value === null || typeof value !== "object") return value;
  const rec = { where, value, read: new Set(), enumerated: false };
  records.push(rec);
  const inner = {};
  for (const [k, v] of Object.entries(value)) inner[k] = tracked(v, `${where}/${k}`, records);
  const note = (k) => typeof k === "string" && rec.read.add(k);
  return new Proxy(inner, {
    get: (t, k, r) => (note(k), Reflect.get(t, k, r)),
    has: (t, k) => (note(k), Reflect.has(t, k)),
    getOwnPropertyDescriptor: (t, k) => (note(k), Reflect.getOwnPropertyDescriptor(t, k)),
    ownKeys: (t) => ((rec.enumerated = true), Reflect.ownKeys(t)),
  });
}

async function schemaProblems(docs) {
  const problems = [];
  for (const d of docs) {
    const id = `${d.kind}/${d.metadata?.name}`;
    const validate = await validatorFor(d.apiVersion, d.kind);
    if (!validate) {
      problems.push(`${id}: no schema for ${d.apiVersion} ${d.kind} (add it to GROUP_PREFIX)`);
      continue;
    }
    const records = [];
    if (!validate(tracked(d, "", records))) {
      for (const e of validate.errors) problems.push(`${id}: ${e.instancePath || "/"} ${e.message || e.keyword} ${JSON.stringify(e.params)}`);
    }
    for (const rec of records) {
      if (rec.enumerated || rec.read.size === 0) continue;
      for (const k of Object.keys(rec.value)) {
        if (!rec.read.has(k)) problems.push(`${id}: unknown field ${rec.where}/${k}`);
      }
    }
  }
  return problems;
}

// --- rendering -----------------------------------------------------------------------------

let notesCopy = null;
function notesChart() {
  if (!notesCopy) {
    notesCopy = path.join(work, "notes-chart");
    fs.cpSync(CHART, notesCopy, { recursive: true, dereference: true });
    const notes = fs.readFileSync(path.join(notesCopy, "templates/NOTES.txt"), "utf8");
    fs.writeFileSync(path.join(notesCopy, "templates/_notes_check.tpl"), `{{- define "tandem.notesCheck" -}}\n${notes}\n{{- end -}}\n`);
    fs.writeFileSync(
      path.join(notesCopy, "templates/notes-check.yaml"),
      'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-check\ndata:\n  notes: {{ include "tandem.notesCheck" . | toJson }}\n',
    );
  }
  return notesCopy;
}

function renderCase(c) {
  const lint = helm(["lint", "--strict", CHART, ...c.args]);
  const problems = [];
  if (lint.status !== 0 || /\[(ERROR|WARNING)\]/.test(lint.stdout)) {
    problems.push(`helm lint: exit ${lint.status}: ${lint.stdout.trim()} ${quiet(lint.stderr)}`);
  }
  const tpl = helm(["template", RELEASE, CHART, "--namespace", NAMESPACE, ...c.args]);
  if (tpl.status !== 0) {
    problems.push(`helm template: exit ${tpl.status}: ${quiet(tpl.stderr)}`);
    return { problems, docs: [] };
  }
  // NOTES.txt is rendered by `helm install` only, which wants a cluster: render
  // it as a template of a copy of the chart instead.
  const notes = helm(["template", RELEASE, notesChart(), "--namespace", NAMESPACE, "--show-only", "templates/notes-check.yaml", ...c.args]);
  const text = notes.status === 0 ? YAML.parse(notes.stdout)?.data?.notes : "";
  if (!text || !text.includes("tandem status") || /<no value>/.test(text)) {
    problems.push(`NOTES.txt: exit ${notes.status}: ${quiet(notes.stderr)}${text}`);
  }
  const docs = [];
  for (const doc of YAML.parseAllDocuments(tpl.stdout)) {
    if (doc.errors.length) problems.push(`rendered YAML: ${doc.errors[0].message}`);
    const v = doc.toJS();
    if (v) docs.push(v);
  }
  return { problems, docs };
}

const byKind = (docs, kind) => docs.filter((d) => d.kind === kind);
const workloads = (docs) => docs.filter((d) => ["StatefulSet", "Deployment", "DaemonSet", "Job"].includes(d.kind));
const podSpecOf = (w) => w.spec.template.spec;
const containersOf = (pod) => [...(pod.initContainers || []), ...(pod.containers || [])];
const matches = (selector, labels) => Object.entries(selector || {}).every(([k, v]) => labels?.[k] === v);
function get(obj, dotted) {
  return dotted.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

// --- checks on containers --------------------------------------------------------------------

function containerProblems(docs, tls) {
  const problems = [];
  for (const w of workloads(docs)) {
    for (const c of containersOf(podSpecOf(w))) {
      const id = `${w.kind}/${w.metadata.name} container ${c.name}`;
      const req = c.resources?.requests || {};
      if (!req.cpu || !req.memory) problems.push(`${id}: no cpu and memory requests`);
      const grpcPort = (c.ports || []).find((p) => p.name.startsWith("grpc"))?.containerPort;
      if (!grpcPort) problems.push(`${id}: no port named grpc*`);
      for (const [kind, service] of [["livenessProbe", ""], ["readinessProbe", "tandem.ready"]]) {
        const p = c[kind];
        if (!p) {
          problems.push(`${id}: no ${kind}`);
        } else if (!tls) {
          if (!p.grpc) problems.push(`${id}: ${kind} is not a native gRPC probe`);
          else {
            if (p.grpc.port !== grpcPort) problems.push(`${id}: ${kind} asks port ${p.grpc.port}, not the gRPC port ${grpcPort}`);
            if ((p.grpc.service ?? "") !== service) problems.push(`${id}: ${kind} asks service '${p.grpc.service}', not '${service}'`);
          }
        } else {
          const cmd = (p.exec?.command || []).join(" ");
          if (!cmd.includes("tandem health") || !cmd.includes(`:${grpcPort}"`) || !cmd.includes("--tls-ca-file")) {
            problems.push(`${id}: ${kind} with TLS is not 'tandem health' on port ${grpcPort} with TLS flags: ${cmd}`);
          }
          if (service && !cmd.includes(`--service ${service}`)) problems.push(`${id}: ${kind} does not ask '${service}'`);
          if (!service && cmd.includes("--service")) problems.push(`${id}: ${kind} should ask for the process (service "")`);
        }
      }
    }
  }
  return problems;
}

// --- references ------------------------------------------------------------------------------

function referenceProblems(docs, external) {
  const problems = [];
  const names = (kind) => new Set(byKind(docs, kind).map((d) => d.metadata.name));
  const configMaps = names("ConfigMap");
  const secrets = names("Secret");
  const services = names("Service");
  const accounts = names("ServiceAccount");
  const known = (set, name, externals) => set.has(name) || externals.includes(name);
  for (const d of docs) {
    if (d.metadata?.namespace && d.metadata.namespace !== NAMESPACE && d.kind !== "ConfigMap") {
      problems.push(`${d.kind}/${d.metadata.name}: namespace ${d.metadata.namespace}, not the release's`);
    }
  }
  for (const w of workloads(docs)) {
    const id = `${w.kind}/${w.metadata.name}`;
    const pod = podSpecOf(w);
    const labels = w.spec.template.metadata?.labels || {};
    if (!matches(w.spec.selector?.matchLabels, labels)) problems.push(`${id}: its selector does not match its pods`);
    if (w.kind === "StatefulSet" && !services.has(w.spec.serviceName)) problems.push(`${id}: serviceName ${w.spec.serviceName} is not rendered`);
    const sa = pod.serviceAccountName || "default";
    if (sa !== "default" && !accounts.has(sa)) problems.push(`${id}: ServiceAccount ${sa} is not rendered`);
    const volumes = new Set((pod.volumes || []).map((v) => v.name));
    for (const t of w.spec.volumeClaimTemplates || []) volumes.add(t.metadata.name);
    for (const v of pod.volumes || []) {
      if (v.configMap && !known(configMaps, v.configMap.name, [])) problems.push(`${id}: volume ${v.name}: ConfigMap ${v.configMap.name} is not rendered`);
      if (v.secret && !known(secrets, v.secret.secretName, external.secrets)) problems.push(`${id}: volume ${v.name}: Secret ${v.secret.secretName} is neither rendered nor an existing one of the values`);
      if (v.persistentVolumeClaim && !external.claims.includes(v.persistentVolumeClaim.claimName)) problems.push(`${id}: volume ${v.name}: claim ${v.persistentVolumeClaim.claimName} is not an existing one of the values`);
    }
    for (const ps of pod.imagePullSecrets || []) if (!known(secrets, ps.name, external.secrets)) problems.push(`${id}: image pull Secret ${ps.name} unknown`);
    for (const c of containersOf(pod)) {
      for (const m of c.volumeMounts || []) if (!volumes.has(m.name)) problems.push(`${id} container ${c.name}: mounts ${m.name}, which is no volume of the pod`);
      for (const e of c.env || []) {
        const cm = e.valueFrom?.configMapKeyRef;
        const sk = e.valueFrom?.secretKeyRef;
        if (cm && !configMaps.has(cm.name)) problems.push(`${id} container ${c.name}: env ${e.name}: ConfigMap ${cm.name} is not rendered`);
        if (sk && !known(secrets, sk.name, external.secrets)) problems.push(`${id} container ${c.name}: env ${e.name}: Secret ${sk.name} unknown`);
      }
    }
  }
  const pods = workloads(docs).map((w) => ({ labels: w.spec.template.metadata?.labels || {}, pod: podSpecOf(w) }));
  for (const s of byKind(docs, "Service")) {
    const selected = pods.filter((p) => matches(s.spec.selector, p.labels));
    if (selected.length === 0) problems.push(`Service/${s.metadata.name}: selects no rendered pod`);
    for (const port of s.spec.ports || []) {
      const named = selected.some((p) => containersOf(p.pod).some((c) => (c.ports || []).some((cp) => cp.name === port.targetPort || cp.containerPort === port.targetPort)));
      if (!named) problems.push(`Service/${s.metadata.name}: port ${port.name} targets ${port.targetPort}, which no selected container has`);
    }
  }
  for (const b of byKind(docs, "PodDisruptionBudget")) {
    if (!pods.some((p) => matches(b.spec.selector?.matchLabels, p.labels))) problems.push(`PodDisruptionBudget/${b.metadata.name}: selects no rendered pod`);
  }
  for (const m of byKind(docs, "ServiceMonitor")) {
    const selected = byKind(docs, "Service").filter(
      (s) =>
        matches(m.spec.selector.matchLabels, s.metadata.labels) &&
        (m.spec.selector.matchExpressions || []).every((e) => e.operator !== "In" || e.values.includes(s.metadata.labels?.[e.key])),
    );
    if (selected.length === 0) problems.push(`ServiceMonitor/${m.metadata.name}: selects no rendered Service`);
    for (const e of m.spec.endpoints) {
      if (!selected.some((s) => s.spec.ports.some((p) => p.name === e.port))) problems.push(`ServiceMonitor/${m.metadata.name}: no selected Service has a port named ${e.port}`);
    }
    for (const s of selected) {
      if (!s.spec.ports.some((p) => p.name === "metrics")) problems.push(`ServiceMonitor/${m.metadata.name}: Service ${s.metadata.name} has no metrics port`);
    }
  }
  return problems;
}

// --- the daemons' own loader -------------------------------------------------------------------

// Flattens the YAML the daemons print (--check-config) into { "a.b": value }.
function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v !== null && typeof v === "object" && !Array.isArray(v)) flatten(v, `${prefix}${k}.`, out);
    else out[`${prefix}${k}`] = v;
  }
  return out;
}

const FAKE = { POD_IP: "10.1.2.3", NODE_NAME: "node-a", POD_NAMESPACE: NAMESPACE };
function envOf(c, podName) {
  const env = {};
  for (const e of c.env || []) {
    if (e.value !== undefined) env[e.name] = e.value;
    const field = e.valueFrom?.fieldRef?.fieldPath;
    if (field === "metadata.name") env[e.name] = podName;
    else if (field) env[e.name] = FAKE[e.name] ?? "x";
  }
  return env;
}
// Kubernetes' $(VAR) expansion in command and args.
const expand = (s, env) => s.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, n) => (n in env ? env[n] : m));

const parameterCounts = new Map();
// Elements of the reference model for these train.* settings, as tandem train writes them.
function referenceParameterCount(train) {
  const key = `${train.d_model}/${train.layers}/${train.context}/${train.heads}`;
  if (!parameterCounts.has(key)) {
    const out = path.join(work, `params-${parameterCounts.size}.bin`);
    const r = run(path.join(BIN, "tandem"), [
      "train", "--train-steps", "1", "--train-global-batch", "1", `--train-d-model=${train.d_model}`,
      `--train-layers=${train.layers}`, `--train-context=${train.context}`, `--train-heads=${train.heads}`,
      `--train-params-out=${out}`,
    ]);
    parameterCounts.set(key, r.status === 0 && fs.existsSync(out) ? fs.statSync(out).size / 4 : `tandem train failed: ${r.stderr.trim()}`);
  }
  return parameterCounts.get(key);
}

function daemonProblems(docs, c) {
  const problems = [];
  const dir = fs.mkdtempSync(path.join(work, "config-"));
  const files = {};
  for (const cm of byKind(docs, "ConfigMap")) {
    for (const [k, v] of Object.entries(cm.data || {})) {
      if (!k.endsWith(".yaml")) continue;
      files[`${cm.metadata.name}/${k}`] = path.join(dir, `${cm.metadata.name}-${k}`);
      fs.writeFileSync(files[`${cm.metadata.name}/${k}`], v);
    }
  }
  const effective = {}; // role -> flattened --check-config output
  for (const w of workloads(docs)) {
    const pod = podSpecOf(w);
    const podName = `${w.metadata.name}-0`;
    const mounts = (c) => (c.volumeMounts || []).map((m) => ({ ...m, volume: (pod.volumes || []).find((v) => v.name === m.name) }));
    for (const ctr of containersOf(pod)) {
      const id = `${w.kind}/${w.metadata.name} container ${ctr.name}`;
      const env = envOf(ctr, podName);
      const argv = [...(ctr.command || []), ...(ctr.args || [])].map((a) => expand(a, env));
      const program = path.join(BIN, path.basename(argv[0]));
      if (!fs.existsSync(program)) {
        problems.push(`${id}: runs ${argv[0]}, which is not in ${BIN}`);
        continue;
      }
      // Point --config at the rendered file through the container's mount.
      const args = argv.slice(1).map((a) => {
        const m = a.match(/^--config=(.*)$/);
        if (!m) return a;
        const mount = mounts(ctr).find((mt) => m[1].startsWith(mt.mountPath + "/") && mt.volume?.configMap);
        const key = mount && `${mount.volume.configMap.name}/${m[1].slice(mount.mountPath.length + 1)}`;
        if (!key || !files[key]) {
          problems.push(`${id}: --config ${m[1]} is no file of a rendered ConfigMap mounted there`);
          return a;
        }
        return `--config=${files[key]}`;
      });
      const r = run(program, [...args, "--check-config"]);
      if (r.status !== 0) {
        problems.push(`${id}: ${path.basename(program)} ${args.join(" ")} --check-config: exit ${r.status}: ${r.stderr.trim()}`);
        continue;
      }
      const cfg = flatten(YAML.parse(r.stdout));
      const role = w.metadata.labels?.["app.kubernetes.io/component"];
      effective[role] ??= cfg;
      // What the daemon will do fits the pod.
      const port = (name) => (ctr.ports || []).find((p) => p.name.startsWith(name))?.containerPort;
      if (!String(cfg.listen_address).endsWith(`:${port("grpc")}`)) problems.push(`${id}: listens on ${cfg.listen_address}, but its gRPC port is ${port("grpc")}`);
      if (!String(cfg.metrics_address).endsWith(`:${port("metrics")}`)) problems.push(`${id}: serves metrics on ${cfg.metrics_address}, but its metrics port is ${port("metrics")}`);
      if (role !== "coordinator" && !String(cfg.listen_address).startsWith(`${FAKE.POD_IP}:`)) {
        problems.push(`${id}: listens on ${cfg.listen_address}: members must listen on the pod's address, which the coordinator hands out`);
      }
      for (const key of ["tls.cert_file", "tls.key_file", "tls.ca_file", "coordinator.token_file", "auth.token_file", "data_dir"]) {
        const f = cfg[key];
        if (!f) continue;
        if (!mounts(ctr).some((m) => f.startsWith(m.mountPath + "/") || f === m.mountPath)) problems.push(`${id}: ${key} ${f} is on no mounted volume`);
      }
      if (c.tls && !cfg["tls.cert_file"]) problems.push(`${id}: TLS is on but tls.cert_file is empty`);
      if (c.auth && !(cfg["auth.token_file"] || cfg["coordinator.token_file"])) problems.push(`${id}: the join token is on but no token file is set`);
      if (role === "worker" && cfg["node.id"] !== podName) problems.push(`${id}: node.id is '${cfg["node.id"]}', not the pod's name`);
      if ("coordinator.address" in cfg) {
        const [host, p] = cfg["coordinator.address"].split(":");
        const svc = byKind(docs, "Service").find((s) => s.metadata.name === host);
        if (!svc || !svc.spec.ports.some((sp) => String(sp.port) === p && sp.name === "grpc")) {
          problems.push(`${id}: coordinator.address ${cfg["coordinator.address"]} is not the coordinator Service's gRPC port`);
        } else if (!matches(svc.spec.selector, byKind(docs, "StatefulSet").find((s) => s.metadata.labels["app.kubernetes.io/component"] === "coordinator")?.spec.template.metadata.labels)) {
          problems.push(`${id}: Service ${host} does not select the coordinator`);
        }
        if (cfg["job.id"] !== effective.coordinator?.["job.id"] && effective.coordinator) problems.push(`${id}: joins job '${cfg["job.id"]}', the coordinator creates '${effective.coordinator["job.id"]}'`);
      }
    }
  }
  // The parameter count the coordinator gives the shard map.
  const coordinator = effective.coordinator;
  const worker = effective.worker;
  const servers = byKind(docs, "StatefulSet").find((s) => s.metadata.labels["app.kubernetes.io/component"] === "server");
  if (!coordinator || !worker) {
    problems.push("no coordinator or no worker configuration was checked");
  } else if (!c.explicitParameterCount) {
    const want = servers && servers.spec.replicas > 0
      ? referenceParameterCount({ d_model: worker["train.d_model"], layers: worker["train.layers"], context: worker["train.context"], heads: worker["train.heads"] })
      : 0;
    if (coordinator["job.parameter_count"] !== want) problems.push(`coordinator job.parameter_count is ${coordinator["job.parameter_count"]}, the workers' model has ${want}`);
    const ranks = (byKind(docs, "StatefulSet").find((s) => s.metadata.labels["app.kubernetes.io/component"] === "worker")?.spec.replicas ?? 0) *
      containersOf(podSpecOf(byKind(docs, "StatefulSet").find((s) => s.metadata.labels["app.kubernetes.io/component"] === "worker"))).length;
    if (coordinator["job.min_workers"] !== Math.max(1, ranks)) problems.push(`coordinator job.min_workers is ${coordinator["job.min_workers"]}, the release has ${ranks} worker ranks`);
  }
  return problems;
}

// --- dashboards and rules ------------------------------------------------------------------------

// JSON with every object's keys sorted: equal for equal data whatever the order of keys.
function canonical(v) {
  if (Array.isArray(v)) return `[${v.map(canonical).join(",")}]`;
  if (v !== null && typeof v === "object") return `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(",")}}`;
  return JSON.stringify(v);
}

function monitoringProblems(docs, c) {
  const problems = [];
  const dashboards = path.join(SOURCE, "deploy/grafana/dashboards");
  const rules = path.join(SOURCE, "deploy/prometheus/rules");
  const jsonFiles = fs.existsSync(dashboards) ? fs.readdirSync(dashboards).filter((f) => f.endsWith(".json")).sort() : [];
  const ruleFiles = fs.existsSync(rules) ? fs.readdirSync(rules).filter((f) => /\.ya?ml$/.test(f)).sort() : [];
  const maps = byKind(docs, "ConfigMap").filter((m) => m.metadata.labels?.grafana_dashboard === "1");
  if (c.dashboards) {
    const rendered = maps.flatMap((m) => Object.keys(m.data || {})).sort();
    if (JSON.stringify(rendered) !== JSON.stringify(jsonFiles)) problems.push(`dashboards rendered ${JSON.stringify(rendered)}, deploy/grafana/dashboards has ${JSON.stringify(jsonFiles)}`);
    for (const m of maps) {
      for (const [k, v] of Object.entries(m.data || {})) {
        try {
          JSON.parse(v);
        } catch (e) {
          problems.push(`ConfigMap/${m.metadata.name}: ${k} is not JSON: ${e.message}`);
        }
        if (v !== fs.readFileSync(path.join(dashboards, k), "utf8").replace(/\n+$/, "")) problems.push(`ConfigMap/${m.metadata.name}: ${k} differs from the file`);
      }
    }
  } else if (maps.length) {
    problems.push("dashboards rendered although metrics.dashboards.enabled is false");
  }
  const rendered = byKind(docs, "PrometheusRule").flatMap((r) => r.spec.groups);
  const want = c.rules ? ruleFiles.flatMap((f) => YAML.parse(fs.readFileSync(path.join(rules, f), "utf8"))?.groups || []) : [];
  const names = (groups) => JSON.stringify(groups.map((g) => g.name));
  if (names(rendered) !== names(want)) problems.push(`PrometheusRule groups ${names(rendered)}, deploy/prometheus/rules has ${names(want)}`);
  else if (canonical(rendered) !== canonical(want)) problems.push("the PrometheusRule's groups differ from deploy/prometheus/rules");
  return problems;
}

// --- the schema's configuration keys against the daemons' -----------------------------------

// Keys the chart sets itself (templates/configmap.yaml and the command lines), per daemon.
const CHART_OWNED = {
  common: ["name", "listen_address", "metrics_address", "ready_file", "tls.cert_file", "tls.key_file", "tls.ca_file", "tls.require_client_cert", "tls.server_name"],
  coordinator: ["data_dir", "auth.token_file", "job.id"],
  server: ["coordinator.address", "coordinator.token_file", "job.id", "node.id"],
  worker: ["coordinator.address", "coordinator.token_file", "job.id", "node.id"],
};
// Keys the chart neither sets nor accepts, per daemon, on purpose: a member's
// incarnation must grow with each container restart (its default, the
// process's start time, does); one value in the shared file would make every
// restart of a pod a refusal instead of a replacement.
const CHART_WITHHELD = {
  coordinator: [],
  server: ["incarnation"],
  worker: ["incarnation"],
};
function schemaKeys(schema, node, prefix = "", out = []) {
  if (node.$ref) node = node.$ref.split("/").slice(1).reduce((o, k) => o[k], schema);
  if (node.type === "object" && node.properties && node.additionalProperties === false) {
    for (const [k, v] of Object.entries(node.properties)) schemaKeys(schema, v, `${prefix}${k}.`, out);
  } else {
    out.push(prefix.slice(0, -1));
  }
  return out;
}
function keyProblems() {
  const problems = [];
  const schema = JSON.parse(fs.readFileSync(path.join(CHART, "values.schema.json"), "utf8"));
  for (const [role, values] of [["coordinator", "coordinator"], ["server", "servers"], ["worker", "workers"]]) {
    const r = run(path.join(BIN, `tandem-${role}`), ["--check-config"]);
    if (r.status !== 0) {
      problems.push(`tandem-${role} --check-config: exit ${r.status}: ${r.stderr}`);
      continue;
    }
    const daemon = new Set(Object.keys(flatten(YAML.parse(r.stdout))));
    const accepted = new Set(schemaKeys(schema, schema.properties[values].properties.config));
    const owned = new Set([...CHART_OWNED.common, ...CHART_OWNED[role]]);
    const withheld = new Set(CHART_WITHHELD[role]);
    for (const k of withheld) {
      if (!daemon.has(k)) problems.push(`the chart withholds '${k}' of tandem-${role}, which it does not read`);
      if (accepted.has(k)) problems.push(`values.schema.json accepts ${values}.config.${k}, which the chart withholds`);
    }
    for (const k of daemon) {
      if (!accepted.has(k) && !owned.has(k) && !withheld.has(k)) problems.push(`tandem-${role} reads '${k}', which values.schema.json (${values}.config) does not accept and the chart does not set`);
    }
    for (const k of accepted) if (!daemon.has(k)) problems.push(`values.schema.json accepts ${values}.config.${k}, which tandem-${role} does not read`);
    for (const k of owned) {
      if (!daemon.has(k)) problems.push(`the chart sets '${k}' of tandem-${role}, which it does not read`);
      if (accepted.has(k)) problems.push(`values.schema.json accepts ${values}.config.${k}, which the chart sets itself`);
    }
  }
  return problems;
}

// With a shared checkpoint claim (servers.checkpoints.existingClaim), every worker container mounts it
// where the servers do: global rank 0 lists it to roll the job back.
function checkpointProblems(docs, c) {
  const problems = [];
  if (!c.external.claims.length) return problems;
  const claim = c.external.claims[0];
  const serverMounts = new Set();
  for (const w of workloads(docs).filter((w) => w.metadata.name.endsWith("-server"))) {
    for (const ct of podSpecOf(w).containers) for (const m of ct.volumeMounts || []) if (m.name === "checkpoints") serverMounts.add(m.mountPath);
  }
  for (const w of workloads(docs).filter((w) => w.metadata.name.endsWith("-worker"))) {
    const pod = podSpecOf(w);
    const volume = (pod.volumes || []).find((v) => v.name === "checkpoints");
    if (volume?.persistentVolumeClaim?.claimName !== claim) problems.push(`${w.metadata.name}: does not mount the checkpoint claim ${claim}`);
    for (const ct of pod.containers) {
      const m = (ct.volumeMounts || []).find((m) => m.name === "checkpoints");
      if (!m || !serverMounts.has(m.mountPath)) problems.push(`${w.metadata.name}/${ct.name}: checkpoints not mounted where the servers have them (${[...serverMounts]})`);
    }
  }
  return problems;
}

// --- cases ---------------------------------------------------------------------------------

function makeCertificate() {
  const dir = path.join(work, "tls");
  fs.mkdirSync(dir);
  const r = run("openssl", [
    "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
    "-subj", "/CN=tandem", "-addext", `subjectAltName=DNS:${RELEASE}-tandem-coordinator`,
    "-keyout", path.join(dir, "tls.key"), "-out", path.join(dir, "tls.crt"),
  ]);
  return r.status === 0 ? dir : null;
}

const valuesOf = (files) => files.map((f) => YAML.parse(fs.readFileSync(f, "utf8")) || {});
function caseFor(name, files, set = [], extra = {}) {
  const values = valuesOf(files);
  const pick = (p) => values.map((v) => get(v, p)).filter((x) => typeof x === "string" && x);
  const any = (p) => values.some((v) => get(v, p) !== undefined);
  const on = (p) => values.some((v) => get(v, p) === true);
  return {
    name,
    args: [...files.flatMap((f) => ["-f", f]), ...set],
    external: {
      secrets: [...pick("tls.existingSecret"), ...pick("auth.existingSecret"), ...values.flatMap((v) => (v.imagePullSecrets || []).map((s) => s.name))],
      claims: pick("servers.checkpoints.existingClaim"),
    },
    tls: on("tls.enabled"),
    auth: on("auth.enabled"),
    dashboards: on("metrics.dashboards.enabled"),
    rules: on("metrics.prometheusRule.enabled"),
    explicitParameterCount: any("coordinator.config.job.parameter_count"),
    ...extra,
  };
}

const ciDir = path.join(CHART, "ci");
const cases = [caseFor("default values", [])];
for (const f of fs.readdirSync(ciDir).filter((f) => f.endsWith("-values.yaml")).sort()) {
  cases.push(caseFor(`ci/${f}`, [path.join(ciDir, f)]));
}
const cert = makeCertificate();
if (cert) {
  cases.push(
    caseFor("TLS and a join token made by the chart", [], [
      "--set", "tls.enabled=true", "--set-file", `tls.certificate=${cert}/tls.crt`, "--set-file", `tls.key=${cert}/tls.key`,
      "--set-file", `tls.ca=${cert}/tls.crt`, "--set", "auth.enabled=true",
      "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.dashboards.enabled=true",
    ], { tls: true, auth: true, dashboards: true, rules: true }),
  );
} else {
  report("make a test certificate with openssl", ["openssl failed"]);
}

for (const c of cases) {
  if (overBudget()) {
    report(c.name, [`not run: the test's ${BUDGET_MS / 1000} s are up`]);
    continue;
  }
  const { problems, docs } = renderCase(c);
  if (docs.length) {
    problems.push(...(await schemaProblems(docs)));
    problems.push(...containerProblems(docs, c.tls));
    problems.push(...referenceProblems(docs, c.external));
    problems.push(...daemonProblems(docs, c));
    problems.push(...monitoringProblems(docs, c));
    problems.push(...checkpointProblems(docs, c));
    if (c.auth && !c.external.secrets.length && !byKind(docs, "Secret").some((s) => s.data?.token)) problems.push("auth is on but no token Secret is rendered");
  }
  report(`${c.name}: lint, render, ${docs.length} objects valid and consistent`, problems);
}

report("values.schema.json accepts exactly the daemons' own configuration keys", keyProblems());

const badDir = path.join(SOURCE, "tests/helm/bad");
for (const f of fs.readdirSync(badDir).filter((f) => f.endsWith(".yaml")).sort()) {
  if (overBudget()) break;
  const text = fs.readFileSync(path.join(badDir, f), "utf8");
  const expect = [...text.matchAll(/^# expect: (.+)$/gm)].map((m) => m[1].trim());
  const r = helm(["template", RELEASE, CHART, "-f", path.join(badDir, f)]);
  const problems = [];
  if (!expect.length) problems.push("the file has no '# expect:' line");
  if (r.status === 0) problems.push("helm template accepted it");
  for (const e of expect) if (r.status !== 0 && !r.stderr.includes(e)) problems.push(`the error does not name '${e}': ${quiet(r.stderr)}`);
  report(`bad values ${f} are refused`, problems);
}

const seconds = ((Date.now() - started) / 1000).toFixed(1);
if (overBudget()) {
  failed++;
  console.log(`FAILED  the test took ${seconds} s, more than its ${BUDGET_MS / 1000} s`);
}
console.log(`\nchart: ${passed} passed, ${failed} failed (${seconds} s)`);
process.exit(failed ? 1 : 0);
