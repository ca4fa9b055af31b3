#!/usr/bin/env python3
"""Tandem's Prometheus rules and Grafana dashboards against a real Prometheus.

Static checks: `promtool check config` and `promtool check rules` pass on
deploy/prometheus, and `promtool test rules` on the alerts' unit tests
(tests/prometheus/alerts_test.yaml: each alert fires on made-up series when
it should, not before, naming its culprit); every dashboard of deploy/grafana/dashboards is valid JSON
with a `datasource` variable of type prometheus that every panel, query and
variable uses; every metric name in a dashboard or rule expression is listed
in docs/metrics.md or is a recording rule of deploy/prometheus/rules.

Live checks: a Prometheus server (Debian's `prometheus`) on loopback, with a
1 s scrape and evaluation interval and the rules of deploy/prometheus/rules
(their `for:` durations cut to 1 s), scrapes a `tandem run --network loopback`
cluster (a coordinator, 2 servers, 2 nodes x 2 workers, a small model) found
through file service discovery as each process writes its ready file. Once
every process has been scraped and the job trains: every rule evaluates
without error, and every recording rule, dashboard panel query and variable
query returns data through the HTTP API, each recording rule's series with
their identity labels (job_id, node_id, rank or server). Then the test kills a worker with
SIGKILL: TandemMemberDown must fire naming it (instance, daemon, job, node and
rank) and TandemMemberDeclaredDead its node, and the queries are checked
again, with the survivors in a new epoch.

The worker is killed by the test rather than by `tandem run --kill-worker-at`
because Prometheus needs several seconds to scrape a new target (its
discovery sends updates every 5 s), and a kill at a fixed step comes sooner
or later depending on the machine's speed. `tandem run` ends the run when one
of its processes dies on its own, so the test stops it (SIGSTOP) just before
the kill, and lets it go on (SIGCONT) to stop the cluster at the end.

The test bounds its own time (--time-limit) and stops every process it
started, by PID, on every exit path: tandem run with SIGINT (it stops its
cluster), the daemons whose ready files it read and Prometheus with SIGTERM,
then SIGKILL. Prometheus runs under `timeout`, so it cannot outlive the test
by long even if the test itself is killed.

Exit status: 0 passed, 1 failed, 77 skipped (promtool or prometheus missing).
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

SKIP = 77
WORKERS_PER_NODE = 2
NODES = 2
SERVERS = 2
# The worker the test kills: the last one, on the last node.
VICTIM = f"worker-{NODES * WORKERS_PER_NODE - 1}"
# Template variables of the dashboards, as Grafana would expand them with
# "All" selected.
VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
    "job_id": ".*",
    "node_id": ".*",
    "rank": ".*",
    "server": ".*",
}
# Labels every series of a recording rule must have, by the rule's name
# (docs/observability.md, "Recording rules").
RECORDED_LABELS = [
    ("tandem:build_info:last", {"daemon"}),
    ("tandem:member_info:last", {"job_id", "node_id"}),
    ("tandem:worker_", {"job_id", "node_id", "rank"}),
    ("tandem:job_", {"job_id"}),
    ("tandem:node_", {"job_id", "node_id", "backend"}),
    ("tandem:ps_", {"job_id", "op", "server"}),
    ("tandem:server_", {"job_id", "node_id", "server"}),
]
# Not metric names: PromQL keywords and the names that may precede "(".
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan", "atan2"}


class Failure(Exception):
    pass


class Interrupted(Exception):
    pass


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- static checks

def documented_metrics(metrics_md):
    """Metric names in the first column of docs/metrics.md's tables (histograms with their series)."""
    names = set()
    for line in open(metrics_md, encoding="utf-8"):
        m = re.match(r"\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(\w+)\s*\|", line)
        if not m:
            continue
        names.add(m.group(1))
        if m.group(2) == "histogram":
            names.update(m.group(1) + s for s in ("_bucket", "_sum", "_count"))
    return names


def recording_rules(rule_files):
    names = set()
    for path in rule_files:
        for line in open(path, encoding="utf-8"):
            m = re.match(r"\s*-\s*record:\s*(\S+)\s*$", line)
            if m:
                names.add(m.group(1))
    return names


def rule_expressions(rule_files):
    """(name, expr) of every rule, from the files' text (block or one-line exprs)."""
    out = []
    for path in rule_files:
        lines = open(path, encoding="utf-8").read().split("\n")
        name = None
        i = 0
        while i < len(lines):
            m = re.match(r"\s*-\s*(?:record|alert):\s*(\S+)", lines[i])
            if m:
                name = m.group(1)
            m = re.match(r"(\s*)expr:\s*(.*)$", lines[i])
            if m:
                indent, rest = len(m.group(1)), m.group(2)
                if rest.strip() in ("|", ">", "|-", ">-"):
                    body = []
                    i += 1
                    while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                        body.append(lines[i])
                        i += 1
                    out.append((name, "\n".join(body)))
                    continue
                out.append((name, rest))
            i += 1
    return out


def expand(expr):
    def sub(m):
        name = m.group(1) or m.group(2)
        if name not in VARIABLES:
            raise Failure(f"unknown template variable ${name} in: {expr}")
        return VARIABLES[name]
    return re.sub(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)", sub, expr)  # not $1 of label_replace


def metric_names(expr):
    """The metric names an expression selects (a small PromQL lexer, enough for our expressions)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        token = m.group(0)
        before = e[m.start() - 1] if m.start() > 0 else " "
        if before.isdigit() or before == ".":
            continue  # part of a number (1e3, 0.5)
        if token in KEYWORDS or re.match(r"\s*\(", e[m.end():]):
            continue  # a keyword, a function or an aggregation
        names.add(token)
    return names


def dashboard_queries(path):
    """(what, expr) of every panel target, variable query and annotation of a dashboard; checks the datasource."""
    try:
        board = json.load(open(path, encoding="utf-8"))
    except ValueError as e:
        raise Failure(f"{path}: not valid JSON: {e}")
    problems = []
    name = os.path.basename(path)
    for key in ("uid", "title", "schemaVersion", "panels", "templating"):
        if key not in board:
            problems.append(f"{name}: no '{key}'")
    if problems:
        raise Failure("\n".join(problems))
    variables = board["templating"]["list"]
    ds = [v for v in variables if v.get("name") == "datasource"]
    if not ds or ds[0].get("type") != "datasource" or ds[0].get("query") != "prometheus":
        problems.append(f"{name}: no template variable 'datasource' of type datasource and query prometheus")
    want = {"type": "prometheus", "uid": "${datasource}"}
    queries = []
    for v in variables:
        if v.get("type") != "query":
            continue
        if v.get("datasource") != want:
            problems.append(f"{name}: variable {v.get('name')} does not use ${{datasource}}")
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q or "")
        if not m:
            problems.append(f"{name}: variable {v.get('name')}: expected label_values(selector, label), got {q!r}")
            continue
        queries.append((f"{name}: variable {v['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    for a in board.get("annotations", {}).get("list", []):
        if a.get("expr"):
            if a.get("datasource") != want:
                problems.append(f"{name}: annotation {a.get('name')} does not use ${{datasource}}")
            queries.append((f"{name}: annotation {a.get('name')}", a["expr"]))
    panels = []
    for p in board["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))  # collapsed rows
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        problems.append(f"{name}: panel ids are not unique")
    for p in panels:
        if p.get("type") == "row":
            continue
        title = p.get("title", "?")
        if p.get("datasource") != want:
            problems.append(f"{name}: panel '{title}' does not use ${{datasource}}")
        if not p.get("targets"):
            problems.append(f"{name}: panel '{title}' has no query")
        for t in p.get("targets", []):
            if t.get("datasource", want) != want:
                problems.append(f"{name}: panel '{title}' query {t.get('refId')} does not use ${{datasource}}")
            if not t.get("expr"):
                problems.append(f"{name}: panel '{title}' query {t.get('refId')} has no expression")
                continue
            queries.append((f"{name}: panel '{title}' {t.get('refId')}", t["expr"]))
    if problems:
        raise Failure("\n".join(problems))
    return board, queries


def static_checks(src, promtool):
    config = os.path.join(src, "deploy/prometheus/prometheus.yml")
    rule_files = sorted(glob.glob(os.path.join(src, "deploy/prometheus/rules/*.yaml")))
    if not rule_files:
        raise Failure("no rule files in deploy/prometheus/rules")
    unit_tests = os.path.join(src, "tests/prometheus/alerts_test.yaml")
    for cmd in ([promtool, "check", "config", config], [promtool, "check", "rules", *rule_files],
                [promtool, "test", "rules", unit_tests]):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        if r.returncode != 0 or "WARNING" in r.stdout:
            raise Failure(f"{' '.join(cmd)} failed:\n{r.stdout}")
    log(f"promtool check config, check rules ({len(rule_files)} rule files) and test rules (the alerts' unit "
        "tests) passed")

    documented = documented_metrics(os.path.join(src, "docs/metrics.md"))
    recorded = recording_rules(rule_files)
    allowed = documented | recorded
    problems = []
    queries = []
    boards = sorted(glob.glob(os.path.join(src, "deploy/grafana/dashboards/*.json")))
    if not boards:
        raise Failure("no dashboards in deploy/grafana/dashboards")
    uids = set()
    for path in boards:
        board, qs = dashboard_queries(path)
        if board["uid"] in uids:
            problems.append(f"{path}: uid {board['uid']} is used twice")
        uids.add(board["uid"])
        for what, expr in qs:
            for metric in metric_names(expand(expr)) - allowed:
                problems.append(f"{what}: '{metric}' is neither in docs/metrics.md nor a recording rule")
        queries.extend(qs)
    for name, expr in rule_expressions(rule_files):
        for metric in metric_names(expr) - allowed:
            problems.append(f"rule {name}: '{metric}' is neither in docs/metrics.md nor a recording rule")
    if problems:
        raise Failure("\n".join(problems))
    log(f"{len(boards)} dashboards: valid JSON, every query on ${{datasource}}; {len(queries)} dashboard queries "
        f"and {len(rule_expressions(rule_files))} rules use only documented metrics and recording rules")
    return rule_files, queries, recorded


# ---------------------------------------------------------------- live checks

class Cluster:
    """The processes this test started, stopped on every exit path."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.run = None  # tandem run
        self.prometheus = None  # timeout wrapping prometheus
        self.daemon_pids = {}  # name -> pid, from the ready files

    def alive(self, pid):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True

    def ours(self, pid):
        """A daemon of this test's cluster (its command line names our work directory), not a reused PID."""
        try:
            return self.tmp.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            return False

    def stop(self):
        if self.run is not None and self.run.poll() is None:
            self.run.send_signal(signal.SIGCONT)  # if the test stopped it
            self.run.send_signal(signal.SIGINT)  # tandem run stops its cluster, as on Ctrl-C
            try:
                self.run.wait(30)
            except subprocess.TimeoutExpired:
                self.run.kill()
                self.run.wait(5)
        for name, pid in self.daemon_pids.items():
            if self.alive(pid) and self.ours(pid):
                log(f"{name} (pid {pid}) outlived tandem run: SIGTERM, then SIGKILL")
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 5
                while self.alive(pid) and self.ours(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.alive(pid) and self.ours(pid):
                    os.kill(pid, signal.SIGKILL)
        if self.prometheus is not None and self.prometheus.poll() is None:
            self.prometheus.terminate()  # timeout passes SIGTERM on to prometheus
            try:
                self.prometheus.wait(15)
            except subprocess.TimeoutExpired:
                self.prometheus.kill()
                self.prometheus.wait(5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise Failure(f"{url}: {body}")
    return body["data"]


def write_atomically(path, text):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for(what, deadline, check, interval=0.25):
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise Failure(f"timed out waiting for {what}")
        time.sleep(interval)


def live_checks(args, rule_files, queries, recorded, cluster, deadline):
    tmp = cluster.tmp
    # Rules: the repository's, with every `for:` cut to 1 s so that alerts fire within the test.
    os.makedirs(os.path.join(tmp, "rules"))
    for path in rule_files:
        text = re.sub(r"(?m)^(\s*for:\s*)\S+\s*$", r"\g<1>1s", open(path, encoding="utf-8").read())
        with open(os.path.join(tmp, "rules", os.path.basename(path)), "w", encoding="utf-8") as f:
            f.write(text)
    jobs = {"tandem-coordinator": "coordinator", "tandem-server": "server", "tandem-worker": "worker"}
    for job in jobs:
        write_atomically(os.path.join(tmp, f"{job}.json"), "[]")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [os.path.join(tmp, "rules", "*.yaml")],
        "scrape_configs": [
            {"job_name": job, "file_sd_configs": [{"files": [os.path.join(tmp, f"{job}.json")],
                                                   "refresh_interval": "1s"}]}
            for job in jobs
        ],
    }
    config_path = os.path.join(tmp, "prometheus.yml")
    write_atomically(config_path, json.dumps(config, indent=2))  # JSON is YAML
    r = subprocess.run([args.promtool, "check", "config", config_path], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60)
    if r.returncode != 0:
        raise Failure(f"the test's Prometheus configuration is not valid:\n{r.stdout}")
    limit = max(10, int(deadline - time.monotonic()) + 20)
    prom_log = open(os.path.join(tmp, "prometheus.log"), "w")
    cluster.prometheus = subprocess.Popen(
        ["timeout", "-s", "TERM", "-k", "5", str(limit), args.prometheus, f"--config.file={config_path}",
         f"--storage.tsdb.path={os.path.join(tmp, 'data')}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"], stdout=prom_log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"

    def prometheus_ready():
        if cluster.prometheus.poll() is not None:
            raise Failure(f"prometheus exited ({cluster.prometheus.returncode}):\n"
                          + open(os.path.join(tmp, "prometheus.log")).read()[-3000:])
        try:
            with urllib.request.urlopen(api + "/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
    wait_for("Prometheus to be ready", min(deadline, time.monotonic() + 30), prometheus_ready)
    log(f"Prometheus {api} ready")

    # The cluster.
    work = os.path.join(tmp, "run")
    run_out_path = os.path.join(tmp, "tandem-run.out")
    run_out = open(run_out_path, "w")
    run_cmd = [os.path.join(args.bin_dir, "tandem"), "run", "--network", "loopback",
               "--nodes", str(NODES), "--workers-per-node", str(WORKERS_PER_NODE), "--servers", str(SERVERS),
               "--steps", "1000000", "--work-dir", work,
               "--timeout", f"{limit}s", "--partition-size", "16KiB",
               "--train-layers", "1", "--train-d-model", "32", "--train-heads", "2", "--train-context", "32",
               "--train-global-batch", "8", "--train-warmup-steps", "0"]
    cluster.run = subprocess.Popen(run_cmd, stdout=run_out, stderr=subprocess.STDOUT)
    log("started: " + " ".join(run_cmd))
    names = ["coordinator"] + [f"server-{i}" for i in range(SERVERS)] + \
            [f"worker-{i}" for i in range(NODES * WORKERS_PER_NODE)]
    ready = {}

    def run_output():
        return open(run_out_path, encoding="utf-8", errors="replace").read()

    def check_run():
        if cluster.run.poll() is not None:
            raise Failure(f"tandem run exited ({cluster.run.returncode}):\n{run_output()[-4000:]}")

    def discover():
        check_run()
        changed = False
        for name in names:
            path = os.path.join(work, f"{name}.ready.json")
            if name not in ready and os.path.exists(path):
                try:
                    info = json.load(open(path))
                except ValueError:
                    continue  # being written
                ready[name] = info
                cluster.daemon_pids[name] = int(info["pid"])
                changed = True
        if changed:
            for job, role in jobs.items():
                targets = [{"targets": [info["metrics_address"]]} for info in ready.values() if info["role"] == role]
                write_atomically(os.path.join(tmp, f"{job}.json"), json.dumps(targets))
        return len(ready) == len(names)
    wait_for("every process's ready file", min(deadline, time.monotonic() + 40), discover, 0.05)
    log(f"{len(ready)} processes ready; their metrics addresses are Prometheus's targets")

    def all_up():
        check_run()
        targets = http_json(api + "/api/v1/targets")["activeTargets"]
        up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
        return all(info["metrics_address"] in up for info in ready.values())
    wait_for("Prometheus to scrape every process", min(deadline, time.monotonic() + 30), all_up)
    log("every process scraped")

    def training():
        check_run()
        result = http_json(api + "/api/v1/query?" + urllib.parse.urlencode({"query": "tandem:job_step:max > 0"}))
        return result["result"]
    wait_for("the job to train", deadline, training)

    # Every rule evaluates; every recording rule and dashboard query returns data.
    def check_queries(when):
        last = None
        while True:
            groups = http_json(api + "/api/v1/rules")["groups"]
            rules = [r for g in groups for r in g["rules"]]
            loaded = {r["name"] for r in rules if r["type"] == "recording"}
            if loaded != recorded:
                raise Failure(f"Prometheus loaded recording rules {sorted(loaded)}, the files have {sorted(recorded)}")
            missing = [f"rule {r['name']}: {r.get('health')} {r.get('lastError', '')}"
                       for r in rules if r.get("health") != "ok"]
            checks = [(f"recording rule {n}", n) for n in sorted(recorded)] + \
                     [(what, expand(expr)) for what, expr in queries if ": annotation " not in what]
            for what, expr in checks:
                url = api + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                try:
                    result = http_json(url)["result"]
                except urllib.error.HTTPError as e:
                    raise Failure(f"{what}: the query fails ({e.code}): {e.read().decode()[:500]}\n  {expr}")
                if not result:
                    missing.append(f"{what}: no data\n    {expr}")
                elif what.startswith("recording rule "):
                    want = next((labels for prefix, labels in RECORDED_LABELS if expr.startswith(prefix)), None)
                    if want is None:
                        raise Failure(f"{what}: RECORDED_LABELS does not say which labels it must have")
                    for series in result:
                        lacking = {k for k in want if not series["metric"].get(k)}
                        if lacking:
                            raise Failure(f"{what}: a series lacks {sorted(lacking)}: {series['metric']}")
            if not missing:
                log(f"{when}: all {len(rules)} rules evaluate without error; all {len(checks)} recording rules and "
                    "dashboard queries return data")
                return
            if time.monotonic() > deadline:
                raise Failure(f"{when}: these return no data (or rules fail):\n  " + "\n  ".join(missing))
            if last != len(missing):
                log(f"{when}: {len(missing)} of {len(checks)} queries without data yet (rates need samples); waiting")
                last = len(missing)
            time.sleep(1)
    check_queries("training")

    # Each server has its own rank, in the servers' metrics and in the workers'.
    for expr in ("tandem:server_info", "tandem:ps_bytes:rate1m"):
        result = http_json(api + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["result"]
        servers = {r["metric"].get("server") for r in result}
        if servers != {str(i) for i in range(SERVERS)}:
            raise Failure(f"{expr}: servers {sorted(servers)}, expected 0 to {SERVERS - 1}: {result}")

    # Kill a worker; tandem run, stopped meanwhile, does not end the run for it.
    info = ready[VICTIM]
    pid = int(info["pid"])
    instance = info["metrics_address"]
    node = f"node-{int(VICTIM.split('-')[1]) // WORKERS_PER_NODE}"
    if not cluster.ours(pid):
        raise Failure(f"{VICTIM} (pid {pid}) is not running")
    cluster.run.send_signal(signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)
    log(f"killed {VICTIM} (pid {pid}, metrics {instance}, {node}) with SIGKILL")

    def alerts(alertname):
        return [a for a in http_json(api + "/api/v1/alerts")["alerts"]
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"]

    def member_down():
        for a in alerts("TandemMemberDown"):
            if a["labels"].get("instance") == instance:
                return a
        return None
    a = wait_for(f"TandemMemberDown to fire for {instance}", deadline, member_down)
    labels = a["labels"]
    want = {"daemon": "worker", "job_id": "default", "node_id": node, "job": "tandem-worker"}
    wrong = {k: labels.get(k) for k, v in want.items() if labels.get(k) != v}
    if wrong or not re.fullmatch(r"\d+", labels.get("rank", "")):
        raise Failure(f"TandemMemberDown does not name {VICTIM} as expected ({want}, a rank): {labels}")
    others = [x["labels"].get("instance") for x in alerts("TandemMemberDown")
              if x["labels"].get("instance") != instance]
    if others:
        raise Failure(f"TandemMemberDown fired for processes that are up: {others}")
    log(f"TandemMemberDown fired: {a['annotations'].get('summary')}")

    def declared_dead():
        for a in alerts("TandemMemberDeclaredDead"):
            if a["labels"].get("node_id") == node and a["labels"].get("kind") == "worker":
                return a
        return None
    a = wait_for(f"TandemMemberDeclaredDead to fire for {node}", deadline, declared_dead)
    log(f"TandemMemberDeclaredDead fired: {a['annotations'].get('summary')}")

    # The survivors go on in a new epoch; the rules follow their new ranks.
    def new_epoch():
        result = http_json(api + "/api/v1/query?" + urllib.parse.urlencode(
            {"query": "tandem:job_world_size == 3 and tandem:job_epoch > 1"}))
        return result["result"]
    wait_for("the survivors to train in a new epoch", deadline, new_epoch)
    check_queries("after the kill")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # As for the other tests, TANDEM_BIN_DIR and TANDEM_SOURCE_DIR override the paths ctest passes.
    p.add_argument("--bin-dir", default=os.path.join(here, "../build/bin"))
    p.add_argument("--source-dir", default=os.path.join(here, ".."))
    p.add_argument("--prometheus", default=shutil.which("prometheus"))
    p.add_argument("--promtool", default=shutil.which("promtool"))
    p.add_argument("--time-limit", type=float, default=120, help="seconds for the whole test")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, Prometheus data)")
    args = p.parse_args()
    args.bin_dir = os.environ.get("TANDEM_BIN_DIR") or args.bin_dir
    args.source_dir = os.environ.get("TANDEM_SOURCE_DIR") or args.source_dir
    start = time.monotonic()
    deadline = start + args.time_limit
    if not args.promtool or not args.prometheus or not shutil.which("timeout"):
        print("SKIPPED: promtool, prometheus or timeout not found (Debian: apt-get install prometheus; "
              "scripts/deps.sh installs it)")
        return SKIP
    for name in ("tandem", "tandem-coordinator", "tandem-server", "tandem-worker"):
        if not os.access(os.path.join(args.bin_dir, name), os.X_OK):
            print(f"FAILED: {args.bin_dir}/{name} is missing: build first")
            return 1

    def interrupted(signum, frame):
        raise Interrupted(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    tmp = tempfile.mkdtemp(prefix="tandem-prometheus-test-")
    cluster = Cluster(tmp)
    status = 1
    try:
        rule_files, queries, recorded = static_checks(args.source_dir, args.promtool)
        live_checks(args, rule_files, queries, recorded, cluster, deadline)
        status = 0
    except Failure as e:
        print(f"FAILED: {e}", flush=True)
        args.keep = True
    except Interrupted as e:
        print(f"INTERRUPTED: {e}", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        if args.keep:
            print(f"logs and Prometheus data kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"{'PASSED' if status == 0 else 'FAILED'} in {time.monotonic() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
