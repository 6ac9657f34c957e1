"""Every default number of inferq, each with where it comes from.

Nothing else in the package spells a default: settings, the data model and the
daemons read them from here, so a reader can audit them in one place.
"""

from __future__ import annotations

#: Key namespace: ``inferq:<namespace>:...``. Tests and demos use their own.
NAMESPACE = "default"
REDIS_URL = "redis://127.0.0.1:6379/0"

# --- priority classes (design brief: realtime 2 s, standard 10 s, batch 60 s) ---
#: Fairness weights 8:3:1 (design brief). Realtime gets 2/3 of contended slots,
#: batch still gets 1/12 so it never starves.
CLASS_WEIGHTS = {"realtime": 8.0, "standard": 3.0, "batch": 1.0}
#: SLA = time to first token (submit -> first output token: queue wait + prefill),
#: the latency an interactive user feels and the target LLM serving systems set
#: (Splitwise, DistServe: TTFT SLOs); generation length is the caller's choice.
CLASS_SLA_S = {"realtime": 2.0, "standard": 10.0, "batch": 60.0}
#: Time-per-output-token target per class, seconds (None: none), as MLPerf Inference's LLM
#: server scenarios state it: 100 ms for Llama-3.1-8B (v5.1), 200 ms for Llama-2-70B (v4.1).
#: Realtime is chat (the 8B figure), standard the 70B one, batch has no per-token target.
CLASS_TPOT_S: dict[str, float | None] = {"realtime": 0.1, "standard": 0.2, "batch": None}
#: Prefill allowance of the length-aware TTFT target (``inferq.sla``), prompt tokens/s:
#: half what an H200 prefills for an 8B model (41,636 tokens/s at 2,048 tokens, issue 16),
#: so a long prompt is allowed twice its own prefill time on top of the class SLA.
SLA_REFERENCE_PREFILL_TPS = 20_000.0
#: Timeout (submit -> final result) per class: long enough for the longest answer
#: in the Azure traces (1,000-1,900 output tokens) at ~30 tokens/s under load.
CLASS_TIMEOUT_S = {"realtime": 120.0, "standard": 300.0, "batch": 3600.0}
#: Batching delay: realtime never waits to fill a batch (design brief); larger
#: classes wait a fraction of their SLA to get fuller batches.
CLASS_BATCH_DELAY_S = {"realtime": 0.0, "standard": 0.05, "batch": 0.5}
#: Aging bound: no request waits longer than this while lower-priority work is
#: served; half the SLA for the lower classes, none needed for the top class.
CLASS_AGING_S = {"realtime": 1.0, "standard": 5.0, "batch": 30.0}
#: Preemption (issue 12): a request of a class with a bound here that has waited
#: this long, with no worker that has room for it, takes room from lower-class
#: work: its reserved worker admits nothing of a lower class until it fits (EASY
#: backfilling's reservation) and running work of preemptible classes is aborted
#: on the model server and requeued (vLLM's recompute preemption). A quarter of
#: the SLA for realtime (0.5 s of 2 s) and half for standard (5 s of 10 s), so the
#: freed room is taken (one tick, a prefill) well inside the SLA. Batch never
#: preempts: its 60 s SLA is met by the aging bound alone.
CLASS_MAY_PREEMPT_AFTER_S: dict[str, float | None] = {
    "realtime": 0.5,
    "standard": 5.0,
    "batch": None,
}
#: Classes whose running work may be preempted by a higher class: batch (minutes of
#: SLA, and a recomputed prefill costs it seconds) and standard, by realtime only (the
#: one class above it). Standard was not at first, and 4 long standard requests then
#: held a realtime request past its 2 s SLA for as long as they ran (4.9 s in
#: tests/redis/test_preemption.py at half time scale, 20 s at full scale): a slot hog
#: of the middle class is still a lower-class hog. Victims are the lowest class
#: first, so standard is aborted only when batch work cannot make the room, and
#: ``MAX_PREEMPTIONS`` bounds what one request can be made to recompute. Realtime is
#: never aborted (nothing is above it).
CLASS_PREEMPTIBLE = {"realtime": False, "standard": True, "batch": True}
#: Per-class queue limit (backpressure, HTTP 429 equivalent). 100k queued
#: requests at ~1 KiB each is ~100 MiB of Redis: far beyond any fleet's backlog.
CLASS_QUEUE_LIMIT = 100_000
#: Per-tenant queue limit per class: one tenant may hold at most a fifth of a class.
TENANT_QUEUE_LIMIT = 20_000

# --- requests ---
#: Largest prompt accepted, in bytes of UTF-8 (issue #2: configurable, default 1 MiB).
MAX_PROMPT_BYTES = 1024 * 1024
#: max_tokens when the caller gives none.
MAX_TOKENS = 256
#: Deliveries before a request goes to the dead letter (design brief's max_attempts).
MAX_ATTEMPTS = 3
#: How long a finished request's record and result stay readable, seconds.
RESULT_TTL_S = 24 * 3600
#: Days a usage roll-up (``P usage:<day>``) is kept after its day ends: a calendar month
#: (31 days) and a few days to bill it in; ``store/lua/includes/meter.lua`` spells it once
#: more (for a deployment whose dispatcher has not written ``usage_retention_days`` yet).
USAGE_RETENTION_DAYS = 35
#: How long an idempotency key maps to its request, seconds (one day, like Stripe's).
IDEMPOTENCY_TTL_S = 24 * 3600
#: How long a dead-lettered request (record ~1.9 KB) is kept for inspection and requeue,
#: seconds: a week covers a weekend and a holiday before anyone looks (issue 12: they
#: never expired); `inferq dead-letter delete` removes them earlier.
DEAD_LETTER_TTL_S = 7 * 24 * 3600
#: Dead-lettered requests past their retention removed per dispatcher tick at most.
DEAD_LETTER_PRUNE_LIMIT = 100
#: Events stream length (approximate MAXLEN): about an hour of a busy fleet.
EVENTS_MAXLEN = 100_000
#: Entries kept in a streamed request's output stream (approximate MAXLEN). The worker
#: writes about one entry per token when it keeps up (more tokens per entry when it
#: coalesces), so 1,024 covers a typical chat answer; a reader that falls further behind
#: gets the whole text from the final result instead (``StreamChunk.reset``).
STREAM_MAXLEN = 1024
#: Characters per token for the fast prompt-size estimate (OpenAI's rule of thumb
#: for English text: ~4 characters per token).
CHARS_PER_TOKEN = 4.0
#: Tokens of chat-template overhead per message (OpenAI cookbook's count: 3-4).
TOKENS_PER_MESSAGE = 4

#: Longest single blocking Redis read (BLMOVE on a result), seconds: redis-py 8
#: closes a socket read after 5 s by default, so longer waits are made of chunks.
BLOCK_CHUNK_S = 2.0

# --- workers and leases ---
#: Heartbeat period, seconds (issue #4: every second by default).
HEARTBEAT_INTERVAL_S = 1.0
#: Longest block of a worker's read of its control channel (``ctl:<id>``), seconds:
#: an abort (a preemption) reaches the model server within this plus one round trip,
#: a small share of realtime's 2 s SLA; stopping the reader waits at most this long.
CONTROL_BLOCK_S = 0.5
#: How long a drain request (``drain:<w>``) lives, seconds: far longer than any drain takes;
#: the worker deletes it when it leaves (remove_worker.lua), so it only bounds a flag whose
#: worker died unseen.
DRAIN_FLAG_TTL_S = 24 * 3600.0
#: A heartbeat hash lives three intervals (issue #4); a worker silent that long is dead.
HEARTBEAT_TTL_INTERVALS = 3
#: Lease length, seconds: heartbeat TTL plus a margin, so one missed beat does not
#: requeue live work but a dead worker's requests return within ~2 beats + margin.
LEASE_S = 5.0
#: A gateway's liveness lease, seconds: it renews it every third of that while it runs;
#: once it lapses (the process died: SIGKILL, OOM, a lost host) the dispatcher cancels
#: the requests submitted through it, since nobody can read their answers. Twice the
#: worker lease: a gateway's event loop may stall on a burst of large bodies, and a
#: false lapse cancels live streams, while a true one only costs the tokens of 10 s.
GATEWAY_LEASE_S = 10.0

#: Share of a card's VRAM a model server claims (vLLM's gpu_memory_utilization
#: default); what is left after the weights is the KV cache.
GPU_MEMORY_UTILIZATION = 0.9

# --- dispatcher ---
#: Tick when nothing wakes the dispatcher, seconds (issue #3: 100 ms).
DISPATCH_TICK_S = 0.1
#: Longest time between two expiry-and-recovery passes of a dispatcher, seconds, whatever
#: its tick: a lost worker's requests return within the reaper's bound (3 heartbeats +
#: this) even with ``--tick 8`` (issue 13, fault 6). Half a heartbeat interval.
RECOVERY_EVERY_MAX_S = 0.5
#: Requests read from the head of each queue per decision round.
QUEUE_HEAD = 256
#: Largest batch the dispatcher forms for one worker, requests.
MAX_BATCH = 32
#: Token budget of one batch (prompt + max_tokens), tokens: vLLM's default
#: max_num_batched_tokens order of magnitude for a single card.
BATCH_TOKEN_BUDGET = 65_536
#: Weight of an output token against an input token in the tenant fair-share
#: counter: VTC (Sheng et al., OSDI 2024) uses w_p=1, w_q=2.
VTC_OUTPUT_WEIGHT = 2.0
#: Preemptions of one request at most (issue 12 attack): a victim is chosen by least
#: progress, so the request just dispatched again after its last preemption is the next
#: victim too; a light realtime stream (a request a second on a one-slot worker) aborted
#: one batch request 30 times in 30 s and it finished only when the stream stopped. A
#: request preempted this often is no longer a victim: it finishes, and the realtime
#: request behind it waits at most that request's run. 3 keeps preemption for the rare
#: hog and bounds the recomputation one request can be made to pay to 3 runs.
MAX_PREEMPTIONS = 3
#: A tenant neither backlogged nor served for this long loses its VTC counter (folded),
#: seconds: longer than a standard request's timeout (300 s) x 3, so a tenant cannot shed
#: its debt by pausing for a request's lifetime; shorter than a day, so 10,000 one-off
#: tenants an hour leave ~2,500 entries, not a record of every tenant that ever existed.
TENANT_IDLE_S = 900.0
#: Idle tenants (and estimate entries) folded per dispatcher step at most: bounds the
#: step's cost while a crowd of one-off tenants ages out (64 x 10 steps/s = 640/s).
FOLD_LIMIT = 64
#: An output estimate of a (model, task type) not updated for this long is dropped,
#: seconds: a day, so a daily job's task type keeps its estimate.
ESTIMATE_IDLE_S = 24 * 3600.0
#: At most this many (model, task type) output estimates are kept (least recently
#: updated dropped first): far above a deployment's real task types, far below the
#: 10,000 a client naming one per request would leave (issue 12).
ESTIMATES_MAX = 1024
#: Tenants per queue whose head requests a dispatcher step reads at least (the tenant
#: index is read in submit order of the tenants' heads): the snapshot sees every tenant
#: of a queue with fewer backlogged tenants, whatever their backlogs.
SNAPSHOT_MIN_TENANTS = 32
#: The dispatcher re-reads the heartbeats of only the workers marked changed since its
#: last step (``P wchanged``, issue 17), and the whole fleet this often as a safety net
#: (a change written outside the scripts, a clock step back); with 5,000 workers a full
#: read costs ~50 ms, so every 5 s it was most of the busy fleet's snapshot.
SNAPSHOT_FULL_REFRESH_S = 20.0
#: How long ``P wchanged`` keeps a mark (``CHANGES_KEEP_MS`` in ``lua/includes/changed.lua``);
#: a dispatcher that has not read the marks for half of it reads the whole fleet.
WORKER_CHANGES_KEEP_S = 60.0

# --- scaler ---
SCALER_INTERVAL_S = 5.0
SCALE_MIN_WORKERS = 1
SCALE_MAX_WORKERS = 8
#: Scale-down only after a worker has been idle this long (issue #5: 300 s).
SCALE_IDLE_S = 300.0
SCALE_UP_COOLDOWN_S = 15.0
SCALE_DOWN_COOLDOWN_S = 60.0

# --- model servers of the workers (issue #4; inferq.workers.servers) ---
#: The sim model server sleeps the latency model's times x this factor (1.0 = real time;
#: 0 = never sleep, for tests and the per-batch overhead benchmark).
SIM_TIME_SCALE = 1.0
#: Where the openai model server client connects: vLLM's default ``--port 8000`` on the host.
OPENAI_BASE_URL = "http://127.0.0.1:8000"
#: Longest wait for the model server to answer ``GET /v1/models`` at start, seconds:
#: vLLM loading a 70B model from network storage takes minutes, not the 30-60 s
#: of local NVMe (design brief), so allow ten.
SERVER_LOAD_TIMEOUT_S = 600.0
#: Pause between two checks while waiting for the model server, seconds.
SERVER_LOAD_POLL_S = 0.5

# --- failures and retries (issue 13; inferq.workers.failures, inferq.workers.health) ---
#: First backoff ceiling of a retry, seconds: full jitter draws from [0, base x 2^(n-1)]
#: (AWS Architecture Blog, "Exponential Backoff And Jitter"); 0.25 s lets the first retry
#: of a realtime request (SLA 2 s) land well inside its SLA.
RETRY_BACKOFF_BASE_S = 0.25
#: Largest backoff ceiling, seconds (issue 13: "the backoff capped, e.g. 30 s"): a server
#: back from an outage is found within ~30 s by requests already waiting.
RETRY_BACKOFF_CAP_S = 30.0
#: Longest ``Retry-After`` honoured, seconds, for a retry and for the pause between two
#: health probes: a server (or a proxy before it) that asks for more is asked again after
#: this long. Issue 13 attack: ``Retry-After: 1000000000`` on a probe kept a worker
#: ``unhealthy`` for 31 years after its server recovered, and its request waited out its
#: deadline in the delayed set.
RETRY_AFTER_CAP_S = RETRY_BACKOFF_CAP_S
#: Pause between two probes of a model server the worker holds unhealthy, seconds:
#: recovery is noticed within a second, at the cost of one cheap request per second.
HEALTH_PROBE_INTERVAL_S = 1.0
#: Longest wait for one health probe (health endpoint or 1-token request), seconds.
HEALTH_PROBE_TIMEOUT_S = 5.0
#: Longest wait of a failed request for the probe's first verdict before it goes back to
#: its queue, seconds (``HealthMonitor.judged``): a server that answers is judged in
#: milliseconds; a busy one whose 1-token probe queues is not waited for longer.
HEALTH_VERDICT_WAIT_S = 1.0
#: Identical request refusals (same status, same message but its numbers) in a row, with
#: no success between them, that make a worker hold its model server broken rather than
#: its requests bad (``inferq.workers.rejections``). Issue 24: a server answering 400 to
#: everything must burn at most 3 requests before it is taken out; one refusal, or two
#: from a caller retrying its own mistake, is the caller's.
BROKEN_SERVER_STREAK = 3
#: Distinct tenants among those refusals, at least: one tenant repeating its own invalid
#: request (a client bug) must not take a healthy server out for everyone.
BROKEN_SERVER_TENANTS = 2
#: Seconds an answer of the ``openai`` backend may stay silent (no byte of a stream, no
#: answer at all) before the server's ``/health`` is checked (its ``stall_s`` option). A
#: decoding server sends a token every few ms to ~100 ms; silence is a long prefill, a
#: queue inside the server, or a hung server (SIGSTOP, a hung GPU): only a ``/health``
#: that does not answer either tells the last apart (issue 13 attack).
SERVER_STALL_S = 10.0
#: The most bytes of one answer the ``openai`` backend reads: this plus
#: ``ANSWER_BYTES_PER_TOKEN`` per ``max_tokens``. A streamed token is one SSE event of
#: ~0.2-0.6 KiB on llama.cpp and vLLM (a few KiB with ``logprobs``); an answer beyond it
#: comes from a server that ignores ``max_tokens`` (issue 13 attack: a 40 MiB body for a
#: 16-token request was read whole and recorded as the output).
ANSWER_BASE_BYTES = 1024 * 1024
#: See ``ANSWER_BASE_BYTES``.
ANSWER_BYTES_PER_TOKEN = 8 * 1024

# --- measured capacity (issue 13; inferq.workers.telemetry, inferq.workers.gpu) ---
#: Pause between two reads of the model server's own telemetry (llama.cpp /slots, vLLM and
#: TGI /metrics), seconds: two HTTP calls of a few KiB; a figure at most ~2 s old beside a
#: 1 s heartbeat (issue 13: "not every beat if costly; a few seconds is fine").
TELEMETRY_INTERVAL_S = 2.0
#: Longest wait for one telemetry read, seconds: a busy server answers its /metrics in
#: milliseconds; one that takes longer is left for the health probe to judge.
TELEMETRY_TIMEOUT_S = 1.0
#: A telemetry read older than this many intervals is dropped from the heartbeat (the
#: bookkeeping alone routes): a server that stopped answering says nothing of its room.
TELEMETRY_STALE_INTERVALS = 3
#: The most bytes of one telemetry page read (``/slots``, ``/metrics``, ``/props``,
#: ``/info``): a few KiB on llama.cpp, hundreds of KiB on vLLM; a larger page is not read
#: further, and the read fails (issue 13 attack: a 24 MiB ``/metrics`` was read whole).
TELEMETRY_MAX_BYTES = 8 * 1024 * 1024

# --- llama.cpp model server (issue 13; ``python -m inferq.llama_server``) ---
#: Port: llama.cpp's own ``llama-server`` default.
LLAMA_PORT = 8080
#: Slots (sequences decoded together). At least the worker's ``--slots``: a request
#: beyond the server's slots waits inside the server, and that wait shows as TTFT.
LLAMA_PARALLEL = 4
#: Context of the whole server, tokens, split evenly over the slots: 8192 / 4 = 2048
#: per request (``smollm2-135m``'s ``max_context``); 8192 is SmolLM2's trained context.
LLAMA_CTX_SIZE = 8192
#: Compute threads. Measured on a 2-core machine shared with other processes: with 2
#: threads decoding slows ~14x whenever another process takes a core (issue 13).
LLAMA_THREADS = 1
#: HTTP threads beyond the slots: a stream holds one until it ends, so health probes
#: and metric scrapes need their own.
LLAMA_HTTP_EXTRA_THREADS = 2
#: On SIGTERM/SIGINT the launcher lets requests in flight finish for this long, seconds:
#: a 256-token answer at the ~35 tokens/s each of 4 busy slots on one thread (measured).
#: What still runs then is cut (llama.cpp's own shutdown never ends with a request in
#: flight, measured with xllamacpp 2026.10.11549).
LLAMA_DRAIN_S = 8.0
#: Backstop for that shutdown once nothing is in flight (it takes ~0.03 s), seconds.
LLAMA_STOP_GRACE_S = 2.0
#: Smallest context per slot the launcher accepts, tokens: a chat template alone
#: takes ~30 tokens of SmolLM2's.
LLAMA_MIN_SLOT_CTX = 128

# --- traces (inferq.traces; simulator and demo load) ---
#: Tenants a trace's requests are spread over when the trace names none (issue 7's
#: "documented defaults"): enough for a fairness index across tenants to mean something.
TRACE_TENANTS = 20
#: Zipf exponent of tenant popularity (rank k has weight 1/k^s): s ~ 1 is the
#: classic skew of service and web popularity; 1.1 gives the top tenant 31.3% of
#: requests and the smallest 1.2% with 20 tenants.
TRACE_TENANT_ZIPF_S = 1.1
#: A synthetic bulk submission (the demo's batch job) arrives within this many
#: seconds: one submit_many call, not a second trace.
SYNTHETIC_BATCH_WINDOW_S = 1.0

# --- estimation (inferq.policy.estimate) ---
#: Smoothing factor of the per-(model, task_type) moving mean of generated tokens:
#: an EWMA with alpha 0.1 weighs roughly the last 2/alpha - 1 = 19 results, enough
#: to follow a shift in prompts within a minute of traffic without chasing outliers.
OUTPUT_ESTIMATE_ALPHA = 0.1

# --- scaling policy (issue #5; inferq.policy.scaling) ---
#: GPUs one worker takes: one model replica per card (design brief: a worker runs
#: "next to one loaded model"); a tensor-parallel 70B replica would set 2 or 4.
SCALE_GPUS_PER_WORKER = 1
#: Tolerance band: hold while the needed workers are within 10% of the current
#: count (the Kubernetes HPA's default --horizontal-pod-autoscaler-tolerance, 0.1).
SCALE_TOLERANCE = 0.1
#: After a direction reversal (a scale-down after a scale-up, or the opposite), no
#: further reversal of the same model for this many seconds, so a pool reverses at most
#: once per 10 minutes on any workload (issue 16's flap bound), by construction.
SCALE_REVERSAL_DWELL_S = 600.0
#: Asymmetric threshold: scale down only to a count that would run at most this share of
#: the capacity the need asks for (need / down_threshold workers), while a scale-up goes to
#: ceil(need) at once: shrinking is cheap to postpone, growing late misses the SLA. 0.9
#: since scale-down follows the need averaged over SCALE_DOWN_WINDOW_S (the average is
#: already the damping): on issue 16's L4 runs 0.8 -> 0.9 saved 1-4% of GPU-seconds at
#: the same flat SLA (1.0: 3-7%, with 0.6 points less SLO on the diurnal day).
SCALE_DOWN_THRESHOLD = 0.9
#: A scale-down is judged on the need averaged over this window (an EWMA of this time
#: constant, after this much has been seen) and a busy worker is drained once the surplus
#: has lasted this long. The Kubernetes HPA damps scale-down the same way (its
#: stabilization window, 300 s by default); 120 s keeps a worker for two minutes of
#: bursts (the Azure code trace swings 1-16 req/s minute to minute) yet follows a
#: 20-minute wave down while it falls (issue 16's sinusoid).
SCALE_DOWN_WINDOW_S = 120.0
#: Share of a worker's KV cache the capacity model fills (inferq.policy.capacity): vLLM
#: preempts sequences when its cache is full, so sizing for 90% leaves room for the
#: spread of request sizes around the window's mean; with SCALE_DOWN_THRESHOLD the
#: fleet settles between 81% and 90% of it (issue 16's goal: at least 70%).
SCALE_TARGET_OCCUPANCY = 0.9
#: Add a worker once a class's oldest wait reaches this fraction of its SLA, so
#: capacity is on its way (cold start 15-45 s) before the SLA is missed.
SCALE_TARGET_WAIT_FRACTION = 0.5
#: Extra capacity should clear the weighted backlog within this many seconds:
#: the SLA of ``standard``, the class of backlog weight 1.
SCALE_BACKLOG_DRAIN_S = 10.0
#: Backlog weight per class: standard's SLA over the class's (10/2, 10/10, 10/60),
#: so a queued request counts in proportion to how soon it must be served.
SCALE_BACKLOG_WEIGHTS = {"realtime": 5.0, "standard": 1.0, "batch": 1.0 / 6.0}
#: A class's backlog counts up to this many times more as its oldest request ages
#: towards its SLA (x2 at the SLA, linear before): old work is more urgent.
SCALE_AGE_FACTOR_MAX = 2.0
#: Time constants of the arrival-rate trend (Holt's double exponential smoothing),
#: seconds: the level follows a change within ~15 s (three 5 s decisions), the slope
#: is averaged twice as long so one noisy interval does not launch a worker (a
#: one-interval doubling of the rate moves the 50 s forecast by ~60%, a steady ramp
#: is extrapolated to ~90% of its true slope within a minute).
SCALE_TREND_LEVEL_S = 15.0
SCALE_TREND_SLOPE_S = 30.0
#: Time constant of the smoothed service time, seconds: a minute of finishes (dozens
#: of requests even on the light Azure code trace), so one long prompt cannot double it.
SCALE_SERVICE_SMOOTHING_S = 60.0
#: Slack before the censoring correction (inferq.policy.capacity.censoring_factor) lowers a
#: capacity sized on finished requests: Little's law over the running requests must give
#: a mean service time this much (20%) above the finishes' before it is believed, so the
#: noise of a 10 s window (a snapshot of in-flight counts, a heavy-tailed mean) does not
#: shrink the capacity in steady state; the cold start's survivorship bias is 2-5x.
SCALE_CENSORING_MARGIN = 0.2

# --- baseline scaling policies the simulator compares (issue #7) ---
#: ``seed``: the seed text's rule: scale up when more than 20 requests are pending
#: and every instance is full, scale down after 300 s idle, checked every 30 s.
SEED_PENDING_THRESHOLD = 20
SEED_IDLE_S = 300.0
SEED_CHECK_S = 30.0
#: ``keda-zcard``: KEDA's Redis list scaler defaults: listLength 5, pollingInterval
#: 30 s, cooldownPeriod 300 s.
KEDA_LIST_LENGTH = 5
KEDA_POLL_S = 30.0
KEDA_COOLDOWN_S = 300.0

# --- scaler platforms (issue #5; inferq.scaler.platforms) ---
#: Seconds ``docker stop`` waits before SIGKILL. The worker has drained and
#: deregistered before stop is called, so this only bounds its clean exit; Docker's
#: own default is 10 s.
DOCKER_STOP_TIMEOUT_S = 30.0
#: ``controller.kubernetes.io/pod-deletion-cost`` set on the pod chosen for
#: scale-down: below the default 0 of every other pod, so the ReplicaSet removes it.
K8S_POD_DELETION_COST = -1000

# --- simulator (issue 7; inferq.sim) ---
#: Slots of a simulated worker: the default of ``inferq worker --slots``.
SIM_WORKER_SLOTS = 8
#: VRAM of a simulated card, MiB: an 80 GiB A100/H100, the usual card for 8B-70B serving.
SIM_VRAM_MIB = 81_920
#: Initial fleet of ``inferq simulate``: four warm 8B workers, about the Azure
#: conversation trace's mean load (5.5 req/s x 5.5 s per request at 8 slots ~ 3.8 workers).
SIM_FLEET = "llama-3.1-8b:4"
#: The synthetic batch job of the default workload is this share of the trace requests
#: (the demo's bulk submission: large enough to need extra workers for minutes).
SIM_BATCH_SHARE = 0.1
#: ... and arrives this far into the replayed window (a quarter: warm fleet, load on).
SIM_BATCH_AT_FRACTION = 0.25
#: ``static-fifo`` is provisioned for the busiest window of this length of the trace:
#: sizing for the peak minute is the common capacity-planning rule for interactive load.
SIM_PEAK_WINDOW_S = 60.0

# --- scaler daemon (issue #5; inferq.scaler) ---
#: Lease of the acting scaler replica, seconds: three decisions at the default 5 s
#: interval, so a replica that dies is replaced within ~15 s and one slow decision
#: (a platform call taking a few seconds) does not hand the lease over.
SCALER_LEASE_S = 15.0
#: Arrival rates and mean service times are measured over this much of the events
#: stream, seconds: two decisions. The policy's Holt smoothing (15 s level) does the
#: averaging, so the window only has to hold enough events (10 at 1 req/s).
SCALER_RATE_WINDOW_S = 10.0
#: Most events read per decision: ``Store.event_rates``' cap (2,000 req/s over 10 s).
SCALER_EVENTS_CAP = 20_000
#: A launched worker that has not registered within this many seconds failed to
#: start (it is stopped and no longer counted as capacity on its way): the worker's
#: own wait for its model server (SERVER_LOAD_TIMEOUT_S, 600 s) plus a minute.
SCALER_START_TIMEOUT_S = 660.0
#: A worker the scaler launched that stays ``unhealthy`` (its model server failing its
#: probes) this long is drained, and the pool launches a replacement, seconds. Two
#: minutes: longer than a model server restart (llama.cpp ~0.6 s measured; an 8B model
#: from local NVMe 15-60 s, the registry's cold starts), so a restart in progress is not
#: replaced, and shorter than Kubernetes' 300 s not-ready toleration
#: (kube-apiserver ``--default-not-ready-toleration-seconds``) after which pods move.
UNHEALTHY_REPLACE_S = 120.0
#: ``local`` platform: seconds ``stop`` waits for a drained, deregistered worker to
#: exit on its own before signalling it (it leaves within a second of deregistering).
LOCAL_STOP_TIMEOUT_S = 10.0
#: ``local`` platform: seconds ``close`` gives each worker to drain after SIGTERM
#: before handing its in-flight requests back (a second SIGTERM): two minutes covers
#: a 4,096-token answer at 40 tokens/s.
LOCAL_DRAIN_TIMEOUT_S = 120.0

# --- the heartbeat process (issue 13, fault 5) ---
#: How long the heartbeat process keeps beating for a worker process that sends it
#: nothing, seconds: a GC pause, an in-process backend holding the GIL, a paused VM or
#: SIGSTOP shorter than this does not get a live worker reaped; a worker hung longer is
#: let go (its heartbeat lapses and its requests are requeued).
HEARTBEAT_STALL_S = 30.0

#: What the result of a request cancelled because its gateway's liveness lease lapsed
#: says (the dispatcher writes it, queued or running); the gateway, alive after all (a
#: stall longer than the lease), answers such a result 503 ``gateway_lease_lapsed`` (the
#: server's fault: retry), not the 409 of a request somebody cancelled.
CALLER_LAPSED = "its liveness lease lapsed"

# --- prefix-cache-aware routing (issue 22) ---
#: Tokens per prefix block of the router-side index. vLLM's KV blocks are 16 tokens
#: and llm-d's router hashes blocks of similar size; a coarser 64 keeps a request's
#: chain short (an 8k-token prompt is 128 hashes, 2 KiB in Redis) while a shared system
#: prompt of a few hundred tokens still matches. A setting per model (``ModelSpec``).
PREFIX_BLOCK_TOKENS = 64
#: Blocks of a chain kept at most: 512 x 64 = 32,768 tokens, the longest context of
#: the default registry; the leading blocks are the ones requests share.
MAX_PREFIX_BLOCKS = 512
#: Weight of a worker's load (tokens it holds: running + assigned, prompt + max_tokens)
#: against the prefill tokens a cache hit saves, in the affinity cost
#: ``uncached prompt tokens + LOAD_WEIGHT x load tokens`` (Dynamo's KV router cost,
#: "prefill blocks to compute + active blocks"). 0.15 is the roofline of the default
#: model (llama-3.1-8b on an H200 profile): a resident KV token costs 30 ns of memory
#: reads per decode step, ~150 steps for Mooncake's mean output (4.5 us), against 34 us
#: to prefill one token at a 15k-token context: 0.13. Tuned on the simulator
#: (scripts/bench_prefix_sim.py): 1.0 (Dynamo's equal weights) kept inferq at 0.55-0.6
#: of the pooled-LRU hit rate, 0.15 reaches 0.84-0.89 with max/mean load <= 1.16.
PREFIX_LOAD_WEIGHT = 0.15
#: Balance thresholds (SGLang's cache-aware router: it stops following the cache when
#: ``max_load - min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold
#: x min_load``; inferq counts tokens, not requests): a cached worker is passed over
#: when it holds this many tokens more than the least-loaded candidate ... 131,072 is
#: about 8 of Mooncake's mean prompts (15k tokens), 28% of an 8B model's KV on an 80 GiB
#: card; 8,192 (half of one such prompt) passed over nearly every hit on the simulator
#: (hit rate 0.58 of pooled on 8 workers), 196,608 let 16 workers drift to 1.28 max/mean.
PREFIX_BALANCE_ABS_TOKENS = 131_072
#: ... and more than this many times its load (SGLang's relative threshold; 2 is where
#: the simulator's max/mean prompt tokens per worker stayed <= 1.16 on 4-16 workers).
PREFIX_BALANCE_REL = 2.0
#: The load weight grows as a request's SLA slack shrinks, up to this factor at no
#: slack left: a request close to its time-to-first-token SLA takes the surer, less
#: loaded worker over a forecast hit (the index is an approximation).
PREFIX_URGENT_LOAD_FACTOR = 4.0
#: The most workers the affinity rule weighs beside the least-loaded pick: a block
#: held by more workers than this (a system prompt every worker has seen) names no
#: candidate (PrefixIndex.deepest). Without the bound a shared prefix made the whole
#: fleet a candidate of every decision (500 workers: the dispatcher's decide 22-57x
#: slower per step, bench_dispatch.py --prefix); workers tied on a widely held block
#: win only on load, where the least-loaded pick is already the best (issue 22).
PREFIX_CANDIDATES = 16
#: Entries of the prefix index's change stream kept (a dispatcher replica that falls
#: further behind, or starts, rebuilds from the stream's retained entries). An entry is a
#: claimed batch's chains, 16 hex digits a block: measured with MEMORY USAGE, 1.3 KB for
#: one request of 64 blocks (4,096 tokens at the default block size), 5.4 KB for four, so
#: 2,000 entries are 2.5-10 MiB of Redis. A batch of ASCII prompts writes at most about
#: 68 KB (chains are cut to the prompts' bytes: BATCH_TOKEN_BUDGET tokens of about 4 bytes,
#: 64 tokens a block), ~136 MiB at the cap; any entry at most MAX_BATCH x
#: MAX_PREFIX_BLOCKS blocks, 262 KB, ~520 MiB (100,000 entries allowed 26 GB).
#: 2,000 batches are minutes of placements for a fleet, about as long as a loaded
#: worker's KV cache keeps a prefix; what a replica misses past them costs hits, never a
#: request.
PREFIX_STREAM_MAXLEN = 2_000
#: Prefix chains the dispatcher remembers (a request's chain is read from Redis once, not
#: every step): twice a 10,000-request backlog in view; a 128-block chain is ~4.6 KiB of
#: Python ints, so ~90 MiB at most with 8k-token prompts.
CHAIN_CACHE_SIZE = 20_000
#: Prefix-log entries a dispatcher reads per step at most (one XRANGE); a backlog beyond
#: it is caught up over the next steps.
PREFIX_LOG_READ = 5_000
