"""Alerts: rules over the run's metrics, events and telemetry, delivered to events.jsonl, the console
and an optional webhook.

Every `alert` event is delivered, whoever emitted it (the straggler detector, the checkpoint manager
and the SDC guard emit their own); the rules here add the others. A rule that fired stays quiet for
`cooldown_s`: one notice per incident, not one per step. Each rule runs where its inputs are: the
metric rules on rank 0 (their values are global), the telemetry rules on each node's local rank 0,
the event rules on the rank that wrote the event, so every alert is delivered exactly once.
deploy/prometheus/keel-rules.yml states the same rules for teams that alert from Prometheus.
"""

from __future__ import annotations

import json
import queue
import re
import statistics
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from keel.config import AlertsConfig
from keel.rundir.events import EventLog

# (event kind, action or "*", guard or "*", rule, severity): events that are alerts in themselves; the
# first match wins. Non-finite steps skipped one at a time are a rate (the nan_skip_rate rule), not each
# an alert; the SDC guard raises its own `sdc_suspect`.
EVENT_RULES = (
    ("guard", "*", "spike", "loss_spike", "error"),
    ("guard", "rolled_back", "numerics", "rollback", "error"),
    ("guard", "stop", "*", "guard_stop", "critical"),
    ("hang", "*", "*", "hang", "critical"),
    ("leave", "*", "*", "quarantine", "error"),
)
CHAT_LIMIT = 2000  # characters of a chat message: Discord refuses a longer `content`
EXPERT_LOADS = re.compile(r"moe/load/layer_(\d+)")  # each expert's share of a layer's tokens (keel.train.experts)


def chat_line(alert: dict) -> str:
    """The alert as the one line a chat channel shows: Slack's incoming webhooks post `text`, Discord's
    `content`, and refuse a body without it."""
    line = " ".join(f"[{alert['severity']}] {alert['alert']} in run {alert.get('run', '?')} at step "
                    f"{alert['step']}: {alert['message']}".split())
    return line if len(line) <= CHAT_LIMIT else line[:CHAT_LIMIT - 1] + "…"


def named(experts: list[dict[str, Any]], share: str, shown: int = 6) -> str:
    """`layer 1 expert 0 at 0%, ...` for the first `shown` experts of an alert, and how many more there are."""
    text = ", ".join(f"layer {e['layer']} expert {e['expert']} at {share.format(e['of_fair'])}"
                     for e in experts[:shown])
    return text + (f" and {len(experts) - shown} more" if len(experts) > shown else "")


class Webhook:
    """POSTs alerts as JSON from a background thread, retrying with exponential backoff. The queue is
    bounded and never waited on: a slow or dead endpoint costs training nothing, alerts beyond the
    queue are dropped and counted."""

    def __init__(self, url: str, timeout_s: float, retries: int, warn: Callable[[str], None]) -> None:
        self.url, self.timeout_s, self.retries, self.warn = url, timeout_s, retries, warn
        self.queue: queue.Queue[dict] = queue.Queue(maxsize=256)
        self.sent = self.failed = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keel-webhook", daemon=True)
        self._thread.start()

    def post(self, alert: dict) -> None:
        try:
            self.queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                alert = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self._deliver(alert)

    def _deliver(self, alert: dict) -> None:
        body = json.dumps(alert).encode()
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                self.sent += 1
                return
            except OSError as e:  # refused, unreachable, timeout, HTTP error status
                error = e
            if attempt < self.retries and self._stop.wait(2.0**attempt):
                break
        self.failed += 1
        if self.failed == 1:
            self.warn(f"warning: the alert webhook {self.url} failed ({error}); alerts are still in events.jsonl")

    def close(self, grace_s: float = 2.0) -> None:
        """Give alerts already queued a moment to go out, then stop."""
        deadline = time.monotonic() + grace_s
        while not self.queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))


class Alerts:
    def __init__(self, cfg: AlertsConfig, events: EventLog, say: Callable[[str], None], labels: dict[str, str]
                 ) -> None:
        self.cfg, self.events, self.say, self.labels = cfg, events, say, labels
        self.webhook = Webhook(cfg.webhook, cfg.webhook_timeout_s, cfg.webhook_retries, say) if cfg.webhook else None
        self.fired: Counter[str] = Counter()  # alerts delivered per rule (the exporter's keel_alerts_total)
        self._last: dict[str, float] = {}
        self._tokens_per_s: deque[float] = deque(maxlen=cfg.throughput_window)
        self._slow_since: float | None = None  # when tokens/s fell below the threshold, and stayed there
        self._errors: dict[str, float] = {}  # the last telemetry counters seen, for increases
        self._starved: dict[tuple[int, int], int] = {}  # (layer, expert) → logged intervals in a row under its share
        self.last_step_time = time.time()
        self.stalled = False
        self.holding = False  # between steps (an evaluation, a blocking save): no step is in progress
        events.subscribe(self._on_event)

    # ------------------------------------------------------------------ delivery
    def fire(self, rule: str, step: int, severity: str, message: str, **detail: Any) -> bool:
        """Raise an alert unless the same rule fired within the cooldown."""
        now = time.time()
        if now - self._last.get(rule, -float("inf")) < self.cfg.cooldown_s:
            return False
        self._last[rule] = now
        self.events.emit("alert", step, rule, severity=severity, message=message, **detail)
        return True

    def _on_event(self, record: dict) -> None:
        kind, action = record["kind"], record["action"]
        if kind == "alert":
            self._deliver(record)
            return
        detail = record.get("detail", {})
        for rule_kind, rule_action, guard, rule, severity in EVENT_RULES:
            if kind == rule_kind and rule_action in ("*", action) and guard in ("*", detail.get("guard")):
                reason = detail.get("reason") or detail.get("message") or ", ".join(
                    f"{k}={v}" for k, v in detail.items() if not isinstance(v, (dict, list)))
                self.fire(rule, record["step"], severity, f"{kind} {action}: {reason}".strip(), source=kind)
                return

    def _deliver(self, record: dict) -> None:
        detail = record.get("detail", {})
        rule, severity = record["action"], detail.get("severity", "warning")
        self.fired[rule] += 1
        self.say(f"ALERT [{severity}] {rule} at step {record['step']}: {detail.get('message', '')}")
        if self.webhook is not None:
            alert = {**self.labels, "alert": rule, "severity": severity, "step": record["step"],
                     "time": record["time"], "rank": record["rank"], "message": detail.get("message", ""),
                     "detail": {k: v for k, v in detail.items() if k not in ("severity", "message")}}
            line = chat_line(alert)
            self.webhook.post({"text": line, "content": line, **alert})

    # ------------------------------------------------------------------ rules over metrics (rank 0)
    def observe(self, step: int, record: dict, steps: int, skipped: int, wall_s: float,
                seconds_since_checkpoint: float, checkpoint_interval_s: float | None,
                now: float | None = None) -> None:
        """One interval's global metrics: `steps` made in it, `skipped` of them dropped by the guards."""
        cfg, now = self.cfg, time.time() if now is None else now
        tokens_per_s = record.get("throughput/tokens_per_s")
        if tokens_per_s is not None:
            if len(self._tokens_per_s) >= 3:
                median = statistics.median(self._tokens_per_s)
                # Slow intervals (a profiled step, an eval, a replay, a busy host) are noise; a drop that
                # lasts `throughput_for_s` is not.
                slow = tokens_per_s < cfg.throughput_drop * median
                self._slow_since = (self._slow_since or now) if slow else None
                if self._slow_since is not None and now - self._slow_since >= cfg.throughput_for_s:
                    self.fire("throughput_drop", step, "warning",
                              f"{tokens_per_s:,.0f} tokens/s is {tokens_per_s / median:.0%} of the trailing median "
                              f"{median:,.0f}", tokens_per_s=tokens_per_s, median=median)
            self._tokens_per_s.append(tokens_per_s)
        logit = record.get("signals/attn_logit_max")
        if logit is not None and logit > cfg.attention_logit:
            self.fire("attention_logit_growth", step, "warning", f"the largest attention logit is {logit:,.0f}, over "
                      f"{cfg.attention_logit:,.0f}: attention is saturating (model.qk_norm keeps it bounded)",
                      attention_logit=logit)
        if steps and skipped / steps > cfg.nan_skip_rate:
            self.fire("nan_skip_rate", step, "error", f"{skipped} of the last {steps} steps were skipped",
                      skipped=skipped, steps=steps)
        goodput = record.get("goodput/ratio")
        if goodput is not None and wall_s >= cfg.goodput_after_s and goodput < cfg.goodput_target:
            self.fire("goodput_low", step, "warning", f"goodput {goodput:.1%} is below the target "
                      f"{cfg.goodput_target:.0%}", goodput=goodput)
        if checkpoint_interval_s and seconds_since_checkpoint > cfg.checkpoint_overdue * checkpoint_interval_s:
            self.fire("checkpoint_overdue", step, "error", f"no checkpoint committed for "
                      f"{seconds_since_checkpoint:.0f} s (expected every {checkpoint_interval_s:.0f} s)",
                      seconds_since=seconds_since_checkpoint)
        self.observe_experts(step, record)

    def observe_experts(self, step: int, record: dict) -> None:
        """A mixture-of-experts model's routing over the interval: an expert that keeps receiving (almost) no
        tokens has collapsed out of the model; a layer whose busiest expert takes many times its fair share
        runs at the pace of that expert under expert parallelism, and drops its tokens under a capacity."""
        cfg = self.cfg
        collapsed: list[dict[str, Any]] = []
        imbalanced: list[dict[str, Any]] = []
        for key, shares in record.items():
            layered = EXPERT_LOADS.fullmatch(key)
            if layered is None or not isinstance(shares, list) or not shares:
                continue
            layer, fair = int(layered.group(1)), 1 / len(shares)
            for expert, share in enumerate(shares):
                starved = share < cfg.moe_collapse_share * fair
                streak = self._starved[(layer, expert)] = self._starved.get((layer, expert), 0) + 1 if starved else 0
                if streak >= cfg.moe_collapse_intervals:
                    collapsed.append({"layer": layer, "expert": expert, "of_fair": round(share / fair, 4)})
            busiest = max(range(len(shares)), key=shares.__getitem__)
            if shares[busiest] / fair > cfg.moe_imbalance_max:
                imbalanced.append({"layer": layer, "expert": busiest, "of_fair": round(shares[busiest] / fair, 4)})
        if collapsed:
            self.fire("moe_collapse", step, "error", f"routing collapse: {named(collapsed, '{:.0%}')} of the fair "
                      f"load, under {cfg.moe_collapse_share:.0%} for {cfg.moe_collapse_intervals} logged intervals "
                      f"in a row", experts=collapsed)
        if imbalanced:
            self.fire("moe_imbalance", step, "warning", f"expert imbalance: {named(imbalanced, '{:.2f}×')} the "
                      f"fair load, over {cfg.moe_imbalance_max:g}×", experts=imbalanced)

    # ------------------------------------------------------------------ rules over telemetry (local rank 0)
    def observe_telemetry(self, readings: list, step: int) -> None:
        for r in readings:
            where = ", ".join(f"{k} {v}" for k, v in r.labels)
            if r.name == "storage_free_ratio" and r.value < self.cfg.storage_free:
                self.fire("storage_nearly_full", step, "error", f"the checkpoint volume has {r.value:.1%} free",
                          free_ratio=r.value)
            elif r.name == "gpu_temperature_celsius" and r.value > self.cfg.gpu_temp_c:
                self.fire("gpu_hot", step, "warning", f"{where} at {r.value:.0f} °C", celsius=r.value)
            elif r.name == "network_carrier_changes_total" and (more := self._increase(r)) > 0:
                node, nic = self.labels.get("node", "this node"), dict(r.labels).get("interface")
                self.fire("link_flapped", step, "warning", f"link flapped on node {node}: interface {nic}, "
                          f"{more:.0f} carrier change(s) since the last sample", node=node, interface=nic,
                          carrier_changes=r.value)
            elif r.name in ("gpu_ecc_errors_total", "gpu_xid_errors_total"):
                if dict(r.labels).get("type", "uncorrected") != "uncorrected":
                    continue
                if (more := self._increase(r)) > 0:
                    rule = "gpu_ecc" if r.name.startswith("gpu_ecc") else "gpu_xid"
                    self.fire(rule, step, "critical", f"{where}: {more:.0f} new "
                              f"{'uncorrected ECC' if rule == 'gpu_ecc' else 'XID'} error(s)", count=r.value)

    def _increase(self, r: Any) -> float:
        """How much a telemetry counter grew since its last sample (0 at its first: what happened before the run
        is not news)."""
        before = self._errors.get(r.key())
        self._errors[r.key()] = r.value
        return r.value - before if before is not None else 0.0

    def check_stall(self, step: int, now: float | None = None) -> None:
        """The step in progress has not finished for `stall_s` (the watchdog acts later, at its timeout)."""
        if self.holding:
            return
        waited = (time.time() if now is None else now) - self.last_step_time
        if waited > self.cfg.stall_s and not self.stalled:
            self.stalled = True
            self.fire("step_stalled", step, "critical", f"step {step + 1} has not finished after {waited:.0f} s",
                      waited_s=round(waited, 1))

    def step_done(self) -> None:
        """A step finished, or the work between two steps did: the next step's stall clock starts now."""
        self.last_step_time = time.time()
        self.stalled = self.holding = False

    def hold(self) -> None:
        """Work between steps begins (its own section of the watchdog times it): no step can stall in it."""
        self.holding = True

    def close(self) -> None:
        self.events.unsubscribe(self._on_event)
        if self.webhook is not None:
            self.webhook.close()
