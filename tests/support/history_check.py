"""Checks what the nodes of a job believed, from every agent's --history-file and the workers'
own lines, after a scenario of network faults (tests/integration/net_faults_test.py, the chaos
soak's network mode).

Agent histories: one JSON object per line (launcher/report/round_history.h). Worker lines: one
JSON object per line that a worker appends while it trains, with its wall time and environment:
{"t_ms", "node", "rank", "world", "restarts", "master"}, node being the name under which the
caller gives that node's history.

check() returns a list of violations (empty when the history holds):
- within a round: no two nodes hold the same group rank or overlapping global ranks, and every
  node agrees on the number of nodes, the world size, the restart count and the master;
- per node: rounds only go up, restart counts never go down; the workers of a round are gone
  before the node takes part in a later one (unless it regrouped them, keep=true);
- every worker line belongs to a round its node was in (same world, restarts, master), and was
  written while that round's workers ran on that node: not after the node's workers_gone for it,
  nor after the node joined a later round;
- a node of a round that ended does not train on: no worker line of round R later than
  `stale_bound_s` after the first moment any node started a later round.
"""
import json


def read_jsonl(path):
    """The objects of a JSON-lines file; a torn last line (a writer killed mid-line) is left out."""
    records = []
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return records
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def check(histories, worker_lines=(), stale_bound_s=None):
    """histories: {name: [events]} (each node's history); worker_lines: [{t_ms, node, world,
    restarts, master, rank}] with node one of the histories' names. See the module's docstring."""
    problems = []
    # A round is named by its coordinator's incarnation and its number: a coordinator that
    # restarted (a supervisor started it again) counts from round 1 again.
    rounds = {}  # (coordinator, round) -> {name: its "round" event}
    for name, events in histories.items():
        for e in events:
            if e.get("event") == "round":
                rounds.setdefault((e.get("coordinator", ""), e["round"]), {})[name] = e
    for (_, number), members in sorted(rounds.items()):
        for key in ("groups", "world", "restarts", "master"):
            values = {e[key] for e in members.values()}
            if len(values) > 1:
                problems.append("round %d: nodes disagree on %s: %s" % (
                    number, key, {n: e[key] for n, e in members.items()}))
        seen_groups = {}
        spans = []
        for name, e in members.items():
            if e["group_rank"] in seen_groups:
                problems.append("round %d: %s and %s both hold group rank %d" % (
                    number, seen_groups[e["group_rank"]], name, e["group_rank"]))
            seen_groups[e["group_rank"]] = name
            if not 0 <= e["group_rank"] < e["groups"]:
                problems.append("round %d: %s holds group rank %d of %d" % (number, name, e["group_rank"],
                                                                              e["groups"]))
            spans.append((e["rank_offset"], e["rank_offset"] + e["nproc"], name))
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                problems.append("round %d: %s (ranks %d-%d) and %s (ranks %d-%d) overlap" % (
                    number, an, a0, a1 - 1, bn, b0, b1 - 1))
        if len(members) > max(e["groups"] for e in members.values()):
            problems.append("round %d: %d nodes took part, more than its %d groups" % (
                number, len(members), max(e["groups"] for e in members.values())))

    # Per node: order of rounds, restart counts, workers gone before the next round.
    windows = {}  # (name, round) -> [start_ms, end_ms or None]
    for name, events in histories.items():
        last_round, last_restarts, running = 0, 0, None  # running: the round whose workers run here.
        coordinator = None
        for e in events:
            kind = e.get("event")
            if kind == "round" and e.get("coordinator", "") != coordinator:
                coordinator, last_round, last_restarts = e.get("coordinator", ""), 0, 0  # It counts anew.
            if kind == "round":
                if e["round"] <= last_round:
                    problems.append("%s: round %d after round %d" % (name, e["round"], last_round))
                if e["restarts"] < last_restarts:
                    problems.append("%s: restart count went down from %d to %d in round %d" % (
                        name, last_restarts, e["restarts"], e["round"]))
                if running is not None and not e.get("keep"):
                    problems.append("%s: round %d began while round %d's workers still ran" % (
                        name, e["round"], running[1]))
                last_round, last_restarts = e["round"], e["restarts"]
                windows[(name, (coordinator, e["round"]))] = [e["t_ms"], None]
            elif kind == "workers_started":
                running = (coordinator, e["round"])
            elif kind == "regrouped":
                if running is not None:
                    windows[(name, running)][1] = e["t_ms"]
                running = (coordinator, e["round"])
            elif kind == "workers_gone":
                key = (name, (coordinator, e["round"]))
                if key in windows and windows[key][1] is None:
                    windows[key][1] = e["t_ms"]
                running = None

    # The first time any node started each round, for the stale bound.
    first_start = {number: min(e["t_ms"] for e in members.values()) for number, members in rounds.items()}
    for line in worker_lines:
        name = line["node"]
        candidates = [(number, members[name]) for number, members in rounds.items() if name in members
                      and members[name]["world"] == line["world"] and members[name]["restarts"] == line["restarts"]
                      and members[name]["master"] == line["master"]]
        if not candidates:
            problems.append("%s: a worker (rank %s) trained in no round its node was in: %s" % (
                name, line.get("rank"), line))
            continue
        key = max((c[0] for c in candidates), key=lambda k: windows[(name, k)][0])  # The latest such round.
        start, end = windows[(name, key)]
        number = key[1]
        if line["t_ms"] < start:
            problems.append("%s: a worker of round %d wrote at %d, before its node took part (%d)" % (
                name, number, line["t_ms"], start))
        if end is not None and line["t_ms"] > end:
            problems.append("%s: a worker of round %d wrote at %d, after its node's workers were gone (%d)" % (
                name, number, line["t_ms"], end))
        later = [first_start[n] for n in first_start if n[0] == key[0] and n[1] > number]
        if stale_bound_s is not None and later and line["t_ms"] > min(later) + stale_bound_s * 1000:
            problems.append("%s: a worker of round %d still trained %.1f s after a later round began" % (
                name, number, (line["t_ms"] - min(later)) / 1000.0))
    return problems
