"""Serving benchmark: ``tether serve`` against llama.cpp's ``llama-server`` (with and without speculation), same GGUF.

Every side serves the built-in default model (``tether.models.default_model_path()``, SmolLM2-135M-Instruct) on
127.0.0.1, each started as a subprocess on a free port, one at a time (never two at once: the machine may have two
cores), with 2 threads (``--quick``: 1), greedy sampling and a context of 2048 tokens per sequence:

- tether: ``python -m tether serve --port P --n-ctx 2048 --threads 2 --parallel 8`` (no ``--model``: the default
  model, the same file; ``--parallel 8`` is ``PARALLEL``, as many sequences as llama-server's slots), at its default
  settings: draftless speculative decoding on. Ready when ``GET /readyz`` returns 200 (503 while loading). Stopped
  with SIGTERM, the exit awaited (bounded; SIGKILL after it, counted in ``forced_kills``). Before the stop the bench
  snapshots the server's descendants (psutil); after it (and a 2 s grace for exits under way),
  ``leftover_processes`` counts those still running plus any process whose command line names ``tether.runner`` and
  either ``--worker=<server pid>`` or the server as its parent. It must be 0 (promise 6); the bench kills what it
  counted.
- tether_nospec (``tether --no-speculation`` in the table): the same command without ``--speculation`` (tether's
  default since serve-20261205T223559Z; the tether side passes ``--speculation``): one token
  per step, nothing drafted. It is the reference for speculation's speed (``speculation_speedup_W_cN``) and for its
  exactness: a greedy text must not depend on whether tokens were guessed ahead (promise 9), so every request's text
  must equal tether's own (``speculation_divergent_texts``, below). Its ``leftover_processes`` count too.
- baseline (``llama_cpp.server`` in the table): ``python -m llama_cpp.server --model PATH --n_ctx 2048 --n_threads 2
  --n_threads_batch 2 --n_batch 512 --seed 0 --interrupt_requests false --port P --host 127.0.0.1``. Ready when
  ``GET /v1/models`` returns 200. Stopped with SIGTERM, then SIGKILL after the bound. ``--interrupt_requests
  false`` is required for a fair concurrent load: by default llama_cpp.server ends a streaming response early (it
  sends ``[DONE]`` after the current token) as soon as another request is waiting for the model, so at concurrency
  4 most streams would be cut short. Everything else is the server as shipped (``verbose`` included). It serves one
  request at a time.
- llama-server (``llama_server`` in the JSON keys): llama.cpp's C++ server, built from the llama.cpp vendored in the
  llama-cpp-python 0.3.36 sdist (the same kernels as ``llama_cpp``; ``bench/llama_server.py`` finds or builds it in
  ``~/.cache/tether-bench``): ``llama-server -m PATH --host 127.0.0.1 --port P -t 2 -tb 2 -c 16384 -np 8 -b 512 -fa
  off --seed 0 --temp 0 --no-webui --cache-reuse 256``. ``-np 8`` gives it 8 slots decoded together (continuous
  batching, its default) and ``-c`` is the total context, ``PARALLEL * 2048``: with an explicit ``-np`` the KV cache
  is not unified, so each slot gets 2048 tokens, the others' per-sequence context. ``-fa off``: its default is
  ``auto``, which turns flash attention on for this CPU, while ``llama_cpp`` (tether's engine, llama_cpp.server)
  builds its contexts without it; with it on, the greedy texts drift from the others' after some tokens (observed on 5
  of the 8 prompts at 32 tokens) and the comparison would be of attention kernels, not servers. ``--no-webui``:
  nothing but the API. It is built without curl, so it cannot download anything; the model is a local path. Its prompt
  cache stays at its default (``cache_prompt`` on: a slot keeps its last prompt's KV and a new request reuses the
  common prefix; idle slots are saved to the RAM prompt cache, ``--cache-ram`` 8192 MiB). Ready when ``GET /health``
  returns 200 (503 while it loads). Stopped with SIGTERM, then SIGKILL after the bound. Its speculation is off by
  default (``--spec-type none``), so this side is llama-server as a user starts it.
- llama_server_spec (``llama-server speculative``): the same command plus its best draftless speculative setting for
  this machine, ``llama_server_spec_config``: tether's speculation needs no second model, so neither may this side's
  (a draft GGUF would be another model, another comparison). Which setting: see *the speculative sweep*.

  Where llama-server comes from: ``--quick`` never builds; it uses the cached binary when ``llama_server.find()``
  finds one (it exists and ``--version`` runs), else its two sides are skipped. A full run builds it when missing
  (about 10 min on two cores, output to ``~/.cache/tether-bench/llama-server-build.log``) unless ``--no-build``. When
  it cannot be found, built or started, ``llama_server_skipped`` (``llama_server_spec_skipped``) says why, its
  figures are null and the rest runs as before. A tether_nospec that does not start is skipped the same way
  (``tether_nospec_skipped``); a tether or llama_cpp.server that does not start is an error.

Server output goes to a log file in a temporary directory (its tail is in the error when a server fails to start).

**The speculative sweep** (before the rounds, once): llama-server's draftless types in this llama.cpp are
``ngram-simple`` (look the last ``size-n`` tokens up in the sequence so far, draft the ``size-m`` that followed),
``ngram-map-k`` (the same from a per-slot map), ``ngram-mod`` (a hashed table of ``n-match``-grams shared by all slots
and kept across requests; a draft of ``n-min`` to ``n-max`` tokens; its ``--spec-default`` preset is its defaults, 24,
48 and 64) and ``ngram-cache``. ``SPEC_CANDIDATES``, five settings: ``--spec-type ngram-mod`` (the defaults);
``ngram-mod`` with ``--spec-ngram-mod-n-match 16 --spec-ngram-mod-n-min 4 --spec-ngram-mod-n-max 24`` (shorter
matches and drafts: a quoted sentence is shorter than 24 + 48 tokens); ``--spec-type ngram-simple`` (size-n 12,
size-m 48); ``ngram-simple`` with ``--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8`` (drafts often, short);
``--spec-type ngram-map-k`` (12, 48). Each starts a llama-server of its own (every other flag as above), warms it up
and runs each of the run's workloads at C=1, ``SWEEP_REQUESTS`` (2) requests at the workload's own ``max_tokens``
(multi_turn: one conversation of two turns), the first prompts (documents) of the C=1 phase. The setting with the
highest geometric mean of tokens/s over the workloads wins (one setting for everything, as a user deploys it; the
geometric mean so that no workload's scale outweighs the others'; the first of equals); a setting that fails to
start or errs is out. ``llama_server_spec_sweep`` lists each setting's ``tokens_per_s`` and ``acceptance`` per
workload, ``geomean``, ``wall_s`` and ``error``; ``llama_server_spec_config`` is the chosen flags and
``llama_server_spec_config_source`` says where they came from (``sweep``, ``--spec-config``, ``default (--quick)``,
``default (--no-spec-sweep)``). Two requests per workload in one pass pick a setting; they do not rank close ones
reliably on a noisy machine (the sweep's figures are not the rounds'). ``--spec-config "FLAGS"`` (``--spec-*`` flags
only) skips it and uses FLAGS (a previous sweep's ``llama_server_spec_config``); ``--no-spec-sweep`` skips it and
uses the first setting. About 35 s a setting, 3 min in all.

Sampling is identical: greedy (``temperature: 0``), ``max_tokens`` 128 (``--quick``: 8), ``seed: 0``, and
``repeat_penalty: 1.0`` in the request body of both llama.cpp servers (llama_cpp.server accepts it as an extra field
and defaults to 1.1; llama-server's chat endpoint accepts it and defaults to 1.0; tether's engine uses 1.0; at
temperature 0 the penalty still changes which token is the argmax). Other sampling fields are left at their
defaults: greedy sampling makes them irrelevant. ``outputs_identical`` checks tether against llama_cpp.server:
every prompt's completion text must be the same on both sides in every round and at every concurrency;
``llama_server_outputs_identical`` checks tether against llama-server the same way (checks, reported, not
figures, and never a failure: a prefix reused from the KV cache of a different previous request, or a batch of
several sequences, can change the float rounding and so, rarely, a greedy choice; and llama-server renders the
chat template with its own Jinja engine).

Requests: ``POST /v1/chat/completions`` with ``stream: true``, ``stream_options: {"include_usage": true}``, a
fixed system message and one of ``PROMPTS`` (stories: answers longer than ``max_tokens``), ``model`` = the first id
of the server's ``GET /v1/models``. At concurrency ``C``, ``C`` clients each send ``N = max(1, R // C)`` requests
back to back (a closed loop; ``R`` = ``--requests``, default 16, so every concurrency sends the same work when ``C``
divides ``R``), request ``j`` of client ``i`` with prompt ``PROMPTS[(i * N + j) % len(PROMPTS)]``: the same
prompts in the same order on every side. ``R`` is 16 rather than 8 so that at C=8 each client sends two requests,
not one: with one, the phase is a single wave of 8 simultaneous arrivals, its TTFT p99 is the maximum of 8 samples
and no request arrives while the server is already generating for the others (what a batching server's admission
between steps is for). One ``httpx.AsyncClient`` per load phase, all clients in one anyio task group. Each server
gets one untimed warm-up request first (``PROMPTS[0]``, 16 tokens). Per request, stamped with
``time.perf_counter()``:

- *TTFT* = from just before the request is sent to the first SSE line ``data: {...}`` whose
  ``choices[0].delta.content`` is non-empty (role-only and empty chunks do not count);
- *inter-token gaps* = the times between successive content chunks of the stream (one chunk is one token on all
  three servers, except where a server holds back a partial UTF-8 character or a possible stop-string prefix, or
  sends a step's accepted drafts together);
- *output tokens* = ``usage.completion_tokens`` when the server sends a usage chunk, else the number of content
  chunks (llama_cpp.server sends no usage in streams). ``tokens_source`` says which each side used;
- *speculation* = tether's ``usage.speculation`` (``draft_tokens``, ``accepted_tokens``, ``decode_steps``) and
  ``usage.completion_tokens_details`` (``accepted_prediction_tokens``, ``rejected_prediction_tokens``) from the usage
  chunk; llama-server's ``timings.draft_n`` and ``timings.draft_n_accepted`` from the same chunk (the final one;
  it leaves both out when it drafted nothing: 0);
- an *error* = a status other than 200, an ``error`` object in the stream, a stream that ends without
  ``data: [DONE]``, no content at all, or an exception (timeout: 120 s per request). ``errors`` (all sides) must be
  0; ``errors_by_side`` splits it.

Per (round, side, concurrency): aggregate output tokens/s = the requests' output tokens / the wall time of the load
phase (first request sent -> last stream ended); the p50 and p99 of the requests' TTFTs; the p99 of the
inter-token gaps, pooled over the phase's requests (``itl``). llama_cpp.server serialises generation (one request at
a time), so its TTFT at C>1 is mostly queueing behind the other clients' requests while its gaps stay those of one
stream; a batching server (llama-server, tether with ``--parallel``) starts the queued requests between steps, so
its TTFT stays short and its gaps grow with the batch. TTFT at C>1 measures throughput as much as latency.

Rounds: ``--rounds`` (default 1: the full run's time budget; ``--quick``: 1). Each round runs every side, one after
the other (start, warm up, each workload at concurrency 1, 4, 8, stop), the order rotating (round 0: tether,
tether_nospec, llama-server, llama-server speculative; round 1 starts at tether_nospec; ...; llama_cpp.server first
when it runs), so with several rounds a slow stretch of a noisy machine falls on every side. Each side's figure is
the median over the rounds of its per-round figures (with one round, that round's). Then, per concurrency C:

- ``tokens_per_s_ratio_cC`` = tether tokens/s / baseline tokens/s (medians over the rounds);
- ``ttft_added_ms_cC`` = tether p50 TTFT - baseline p50 TTFT (medians over the rounds);
- ``tokens_per_s_ratio_vs_llama_server_cC`` = tether tokens/s / llama-server tokens/s (null when skipped);
- per side (``baseline``, ``tether``, ``tether_nospec``, ``llama_server``, ``llama_server_spec``):
  ``SIDE_tokens_per_s_cC``, ``SIDE_ttft_p50_ms_cC``, ``SIDE_ttft_p99_ms_cC``, ``SIDE_itl_p99_ms_cC`` (``distinct``).

Headlines: ``tokens_per_s_ratio`` = the minimum over the concurrencies of the ratio to llama_cpp.server (the target
must hold at every load); ``ttft_added_ms`` = the figure at the lowest concurrency, 1 by default (no queueing: what
the server adds to one request's first token). ``meets_target`` = ``tokens_per_s_ratio >= target_ratio`` (0.98).
Against the C++ server: ``tokens_per_s_ratio_vs_llama_server_c1``/``_c4``/``_c8``, ``ttft_p50_ms_c8`` (tether)
beside ``llama_server_ttft_p50_ms_c8``: how close tether gets to llama.cpp's own batching server.

Reading the figures: on a shared two-core machine another program's burst can halve one phase's rate (llama.cpp's
threads wait for each other at every step, so a stolen core costs far more than its share); the per-round table
shows such a phase, and with ``--rounds 3`` the median drops it. Observed on such a machine: llama_cpp.server's
aggregate rate at concurrency 4 stays well below its rate at concurrency 1 and its rate varies from phase to phase
far more than tether's, with the machine otherwise idle (it then uses about 1.2 of the 2 cores instead of 1.9); so
the C>1 ratios to it say how each server copes with queued requests, not what tether's layers cost, and the
headline minimum is normally the C=1 ratio.

Statistics: p50/p99 = ``statistics.quantiles(samples, n=100, method="inclusive")`` (``benchstats.percentile``).
Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at
the end). Without the default model (``DefaultModelMissing``) the figures are null and ``skipped`` says why (exit
0). A tether or llama_cpp.server that does not start is an error: null figures, ``error`` says why, exit 1 (a
llama-server or tether_nospec that does not start only skips its side).

``--quick`` (for CI): 1 round, concurrency 1 and 2, ``R`` = 2 (2 requests at C=1, 1 per client at C=2), ``max_tokens`` 8
(4 in the other workloads; ``"quick": true``), 1 thread, every side but llama_server_spec, the workloads ``distinct``
and ``code_edit`` (code_edit and its prediction phase at C=1 only: ``grounded_concurrency``; each file cut to its first
12 lines, ``QUICK_CODE_LINES``), no sweep; its figures are only a smoke test.
llama-server runs in it only when already built (it starts in under a second); without a cached binary the quick
run skips both llama-server sides.

**Workloads** (``--workloads``, default all six, in this order; the batching sides run each, llama_cpp.server only
``distinct``). Each runs at every concurrency in turn, on a server that has served the workloads before it (so
caches are warm, as in a deployment). Three controls, where nothing of the answer is in the prompt (speculation
has little to draft from: what it costs where it does not help):

- ``distinct``: the requests above (a short system message, one of ``PROMPTS``; ``max_tokens`` 128);
- ``shared_prefix``: ``LONG_SYSTEM`` (a deployed assistant's instructions, ~580 tokens with the chat template)
  then one of ``QUESTIONS``, ``max_tokens`` 64; each concurrency asks its own 16 questions (the same ``R``
  requests as ``distinct``), so only the system prompt repeats;
- ``multi_turn``: ``CONVERSATIONS`` (24) conversations of ``TURNS`` (6) turns each, ``max_tokens`` 48, every turn
  resending the whole history (the server's own earlier answers) plus a follow-up; client ``i`` of ``C`` holds the
  conversations ``k % C == i`` and sends turn 1 of each, then turn 2 of each, ...: more conversations than slots,
  interleaved, so a conversation's cells are overwritten (or saved to RAM) between its turns. Each concurrency has
  its own 24 topics.

``distinct`` repeats its 8 prompts (twice a phase, in every phase, and ``PROMPTS[0]`` in the warm-up), and a greedy
answer to a repeated prompt is the same answer: a server that drafts from earlier requests' completions (tether
keeps them; llama-server's ``ngram-mod`` table is shared by its slots and kept across requests) can draft it whole.
So on ``distinct`` speculation's figures are those of a repeated request, not of a fresh one; ``shared_prefix`` (48
questions, none repeated) is the control for a fresh prompt. ``distinct`` is kept as it was so that its figures
stay comparable with the earlier records.

and three grounded ones, where the answer copies or follows a document in the prompt (what draftless speculation is
for), each request with the short system message and a user message built on its own document:

- ``code_edit``: a Python file of 45-65 lines (1500-2100 characters, 346-648 tokens): consecutive whole top-level
  functions and classes of a standard-library module (``CODE_FILES``, at most two slices each), in a ```python
  block, then "Rename the function `X` to `X_v2` and return the whole file, unchanged otherwise, in one ```python
  block." (X: the file's first function or class; a class becomes `XV2`). ``max_tokens`` 768: the longest file,
  its fences and a sentence around them fit, so a model that does as asked is never cut; one that chats on is cut
  at 768 (a truncated return is still a copy: its rate is what counts);
- ``code_edit_prediction`` (not a ``--workloads`` choice: it runs on tether's sides, after the workloads, whenever
  ``code_edit`` does, at ``--prediction-concurrency``, default every concurrency): ``code_edit``'s requests with
  OpenAI's Predicted Outputs, ``"prediction": {"type": "content", "content": <the original file>}``, sent to tether;
  tether_nospec gets the same requests without ``prediction``: the reference texts. Its files are other slices
  (``code_edit`` takes the even ones of ``code_documents()``, this phase the odd ones, so the two draw from the same
  modules alike), never a repeat of a request the server already answered: a repeat would be served from the prompt
  cache and from whatever n-grams the server kept, and flatter the prediction. llama-server has no ``prediction``
  (it ignores the field), so its sides do not run it;
- ``rag_quote``: a passage of 220-380 words, then "Which sentence of the passage contains the word "W"? Quote that
  sentence exactly, then explain it in one short sentence." (W: the longest word of 6+ letters found in no other
  sentence, from the sentence of 10+ words nearest the middle); ``max_tokens`` 128;
- ``summarize``: a passage of 400-650 words (a long one) after "Summarize the following text in one paragraph.";
  ``max_tokens`` 200.

The passages are real prose that exists offline: the plain-prose paragraphs of pydoc's topics
(``pydoc_data.topics``, the language reference's text that ``help()`` shows: no code, grammar, tables or
headings), whole paragraphs packed topic by topic, alternately into a ``summarize`` and a ``rag_quote`` passage, so
no paragraph is in two documents. Everything is deterministic for a given Python (``documents_python``: 3.11.7 here;
files are read as text, never imported). Prompts are 420-1180 tokens; with ``max_tokens`` at most 1500 per sequence,
within the 2048 of every side. A grounded phase at concurrency C sends max(4, 2 * C) requests (4, 8, 16: two per
client from C=2, as ``distinct`` at C=8; four at C=1, where each request is slowest). Every phase takes its own
documents, after those of the phases before it: 28 per workload in a server's run (28 more for
``code_edit_prediction``), of 32 available (``documents`` in the JSON: available and needed; past 32 they would
repeat). So no two requests of a phase, nor of a server's run, share a document: nothing is a cross-request repeat
that a prompt cache or ngram-mod's shared table could serve. Every side gets the same documents in the same order.

Keys per workload ``W`` and concurrency ``N`` (all at every concurrency; ``ttft`` p50, ``itl`` p99):
``tokens_per_s_W_cN``, ``ttft_p50_ms_W_cN``, ``itl_p99_ms_W_cN`` (tether), the same prefixed
``tether_nospec_``, ``llama_server_``, ``llama_server_spec_``; ``tokens_per_s_ratio_vs_llama_server_W_cN`` (tether
over llama-server at its defaults) and ``tokens_per_s_ratio_vs_llama_server_spec_W_cN`` (over its speculative
setting); ``speculation_speedup_W_cN`` (tether over tether_nospec) and ``llama_server_speculation_speedup_W_cN``;
``acceptance_W_cN`` = sum(accepted_tokens) / sum(draft_tokens) over the phase's answered requests (all rounds
pooled; null where nothing was drafted), ``tokens_per_step_W_cN`` = sum(completion_tokens) / sum(decode_steps),
``draft_tokens_W_cN``; ``llama_server_spec_acceptance_W_cN`` = sum(draft_n_accepted) / sum(draft_n),
``llama_server_spec_tokens_per_step_W_cN`` = completion tokens / (completion tokens - accepted drafts) (derived:
each of its steps samples one token and keeps the drafts it accepts; its timings count no steps),
``llama_server_spec_draft_tokens_W_cN``; ``prefix_hit_tokens_share_W`` (and prefixed per side): the prompt tokens
the server's cache supplied over all prompt tokens, from ``usage.prompt_tokens_details.cached_tokens``
(llama-server: that, or ``timings.cache_n``).
``distinct_prompts_differing_across_phases`` (and ``llama_server_...``): how many of ``distinct``'s prompts got
more than one greedy text from the same server across its phases (other cache states, other neighbours): what
prefix reuse costs in exactness, measured the same way on both. ``llama-server`` runs with its best settings for
these: ``cache_prompt`` on (its default), ``--cache-reuse 256`` (reuse by KV shifting too), its default RAM cache.

Prediction keys per ``N``: ``tokens_per_s_code_edit_prediction_cN`` (and ``ttft_p50_ms_``, ``itl_p99_ms_``,
``tether_nospec_tokens_per_s_``); ``prediction_speedup_code_edit_cN`` = tether's tokens/s with prediction over its
tokens/s on ``code_edit`` without (other files of the same kind: the phase's own);
``prediction_speedup_vs_nospec_code_edit_cN``: over tether_nospec on the very same requests;
``tokens_per_s_ratio_vs_llama_server_spec_code_edit_prediction_cN``: over llama-server's speculative ``code_edit``
(each server's best for the task); ``prediction_accepted_tokens_code_edit_cN`` and
``prediction_rejected_tokens_code_edit_cN``: sums over the phase's requests, all rounds;
``prediction_acceptance_code_edit_cN``: accepted over both; ``acceptance_code_edit_prediction_cN`` and
``tokens_per_step_code_edit_prediction_cN`` from ``usage.speculation``.

Exactness under speculation: ``speculation_divergent_texts_W`` = the requests whose completion text differs between
tether and tether_nospec for the same request (same round, workload, concurrency and place in the phase: client
``i``'s request ``j``, or a conversation's turn), compared only where both answered it;
``speculation_divergent_texts_code_edit_prediction``: tether with ``prediction`` against tether_nospec without;
``speculation_divergent_texts`` the total, ``speculation_compared_texts`` the requests compared (null totals where
tether_nospec did not run). It must be 0 (promise 9), at every concurrency, which is why tether_nospec runs every
phase by default: a verification step puts several positions of a sequence in one batch, and a batch's shape is
where greedy texts have differed before (DESIGN's batch variance). ``--nospec-concurrency 1`` checks C=1 only and
saves about 6 min. ``llama_server_speculation_divergent_texts[_W]`` and ``llama_server_speculation_compared_texts``:
the same between llama-server's speculative side and its default one (reported for comparison, never a failure).

``--variants logprobs json_schema`` (default ``json_schema``; ``--quick``: none): after tether's and llama-server's
load phases, the highest concurrency again with that option in every request (``logprobs: true, top_logprobs: 5``;
``response_format`` ``json_schema`` with ``STORY``, the stories as a JSON object whose story has at least
``STORY_MIN_CHARS`` characters, so that a structured answer runs to ``max_tokens`` as a plain one does and the ratio
is the grammar's cost per token, not a shorter answer's larger share of prefill); ``SIDE_tokens_per_s_VARIANT_cC``,
``SIDE_VARIANT_vs_plain_cC`` (its rate over the same side's plain rate: the option's cost) and
``tokens_per_s_ratio_vs_llama_server_VARIANT_cC``; ``json_schema_over_plain`` (tether) and
``llama_server_json_schema_over_plain``: that ratio for json_schema. The plain phases are unchanged by it.

Sides: ``--sides``, default tether, tether_nospec, llama_server and llama_server_spec (``--sides`` adds baseline,
llama_cpp.server, whose keys are the ``baseline_`` and ``tokens_per_s_ratio_cC`` ones; it runs ``distinct``
only, one request at a time: about 2 min more); ``--quick`` runs all five. A side left out has null figures.

Time (the default run: four sides, six workloads, the prediction phase, C = 1, 4, 8, one round, the sweep), on
this 2-core machine, where SmolLM2-135M decodes 70-100 tokens/s alone and 120-185 batched (less with a long
context), estimated from those rates without speculation (speculation shortens the grounded phases): the sweep
~3 min; per side the controls ~4.4 min (distinct ~0.8, shared_prefix ~0.6, multi_turn ~3.2: 6,912 tokens a phase;
json_schema ~0.2 on tether and llama-server), code_edit ~2.3 min (28 answers of ~500 tokens and 16k prompt tokens),
rag_quote ~0.8, summarize ~1.2; code_edit_prediction ~1.3 min on tether and ~2.3 on tether_nospec; starts and
warm-ups under 1 min in all. So tether ~9 min, tether_nospec ~11, llama-server ~8.6, llama-server speculative
~8.4: about 40 min in all (45 if decoding runs at the low end of those rates or code_edit answers run to 768
tokens).

Another model: ``--model NAME|FILE`` (a pulled model's name, or a GGUF file; ``--chat-template NAME`` for one
without a template, as Gemma 3 270M's base model), for tether and llama-server. ``--deterministic``: tether serves
with ``--deterministic`` (``bench/deterministic_cost.py`` runs it with and without, alternating, and compares).
``--conversations``/``--turns``: a shorter ``multi_turn``.

Run: ``.venv/bin/python bench/serve.py [--quick] [--no-build] [--rounds N] [--sides ...] [--workloads ...]
[--spec-config FLAGS | --no-spec-sweep] [--nospec-concurrency N ...] [--variants ...]``. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

import llama_server
from benchstats import PERCENTILE, closed_loop, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from tether.errors import InvalidModel
from tether.models import default_model_path, named_or_file

SIDES = ("baseline", "tether", "tether_nospec", "llama_server", "llama_server_spec")
LABELS = {
    "baseline": "llama_cpp.server",
    "tether": "tether",
    "tether_nospec": "tether --no-speculation",
    "llama_server": "llama-server",
    "llama_server_spec": "llama-server speculative",
}
# the prefix of a side's per-workload keys (tether's are bare: tokens_per_s_W_cN)
KEY_PREFIX = {
    "baseline": "baseline_",
    "tether": "",
    "tether_nospec": "tether_nospec_",
    "llama_server": "llama_server_",
    "llama_server_spec": "llama_server_spec_",
}
BATCHING_SIDES = ("tether", "tether_nospec", "llama_server", "llama_server_spec")  # run every workload
LLAMA_SIDES = ("llama_server", "llama_server_spec")  # need the C++ binary
TETHER_SIDES = ("tether", "tether_nospec")
OPTIONAL_SIDES = ("tether_nospec", "llama_server", "llama_server_spec")  # one that does not start is skipped
CONCURRENCY = (1, 4, 8)
QUICK_CONCURRENCY = (1, 2)  # --quick: one client and a batch of them, the two paths
PARALLEL = 8  # llama-server's slots, and tether's --parallel when it has one
TARGET_RATIO = 0.98
N_CTX = 2048  # per sequence
THREADS = 2
QUICK_THREADS = 1  # --quick: every side on one core (a tiny model's second thread mostly waits at the barriers)
N_BATCH = 512
SEED = 0
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 8
REQUESTS = 16
QUICK_REQUESTS = 2
WARMUP_TOKENS = 16
SYSTEM = "You are a helpful AI assistant."
PROMPTS = (
    "Write a story about a lighthouse keeper who finds a message in a bottle.",
    "Write a story about a robot that learns to bake bread.",
    "Write a story about two friends lost in a forest at night.",
    "Write a story about a dragon who is afraid of fire.",
    "Write a story about a girl who builds a boat to cross the ocean.",
    "Write a story about a cat who becomes the mayor of a small town.",
    "Write a story about an old clock that starts running backwards.",
    "Write a story about a farmer who finds a door in the middle of his field.",
)
STORY_MIN_CHARS = 800  # ~180 tokens of story: a json_schema answer is as long as a plain one (max_tokens 128)
CONTROLS = ("distinct", "shared_prefix", "multi_turn")  # nothing in the answer is in the prompt
GROUNDED = ("code_edit", "rag_quote", "summarize")  # the answer copies or follows a document in the prompt
WORKLOADS = (*CONTROLS, *GROUNDED)
QUICK_WORKLOADS = ("distinct", "code_edit")  # a smoke test: one control, one grounded workload
PREDICTION = "code_edit_prediction"  # code_edit with OpenAI's prediction = the original file (tether's sides only)
PHASES = (*WORKLOADS, PREDICTION)
# shared_prefix: one long system prompt (~600 tokens) before every request's own question, as a deployed assistant's
_RULES = (
    "greet the visitor by name when they give one",
    "answer in plain English, in at most three short paragraphs",
    "mention the exhibit that fits the question, with its room number",
    "never invent opening hours, prices or dates you were not given",
    "say so when you do not know, and suggest asking at the front desk",
    "keep a friendly tone, with no jokes about the sea's dangers",
    "point families with children to the interactive rooms on the ground floor",
    "remind visitors that photographs without flash are welcome everywhere",
    "describe every ship model with its name, its year and its home port",
    "explain nautical words the first time you use them",
    "suggest the guided tour, which starts every hour in the main hall",
    "recommend the cafe on the roof terrace when someone asks about food",
)
_ROOMS = (
    "the lighthouse room, with a working lens from 1887",
    "the hall of anchors, forty anchors from twelve centuries",
    "the navigation room, with compasses, sextants and star charts",
    "the sail loft, where sails are still sewn by hand on Saturdays",
    "the knot bench, where visitors learn six knots in ten minutes",
    "the map gallery, with the first charts of the northern coast",
    "the whale room, with the skeleton of a fin whale found in 1921",
    "the storm theatre, a film about the great storm of the old harbor",
    "the harbor model, the whole port in 1900 at one to two hundred",
    "the shipyard, where a fishing boat is being built the old way",
)
LONG_SYSTEM = (
    "You are Harbor, the visitor assistant of the Northern Maritime Museum. Follow these rules. "
    + " ".join(f"Rule {i + 1}: {rule}." for i, rule in enumerate(_RULES))
    + " The museum's rooms are: "
    + "; ".join(f"room {i + 1}, {room}" for i, room in enumerate(_ROOMS))
    + ". "
    + " ".join(
        f"About room {i + 1}: it is on floor {i % 3}, it takes about {10 + 5 * (i % 4)} minutes to see, it has "
        f"benches, and its guide explains {room.split(',')[0]} every half hour."
        for i, room in enumerate(_ROOMS[:4])
    )
)
_SUBJECTS = (
    "lighthouses",
    "anchors",
    "compasses",
    "sails",
    "knots",
    "sea charts",
    "whales",
    "storms",
    "harbors",
    "fishing boats",
    "tides",
    "sextants",
    "ship bells",
    "figureheads",
    "rope making",
    "steam ships",
)
QUESTIONS = tuple(  # shared_prefix's own questions: 48, so each concurrency asks 16 the others do not
    f"{opening} {subject}?"
    for opening in ("What can I learn here about", "Which room should I visit for", "Tell me one fact about")
    for subject in _SUBJECTS
)
CONVERSATIONS = 24  # multi_turn: more conversations than slots, interleaved, each turn resending its history
TURNS = 6
QUICK_CONVERSATIONS, QUICK_TURNS = 8, 2
_CITIES = (
    "Lisbon",
    "Oslo",
    "Genoa",
    "Bergen",
    "Valparaiso",
    "Hamburg",
    "Marseille",
    "Halifax",
    "Cadiz",
    "Gdansk",
    "Dubrovnik",
    "Porto",
    "Antwerp",
    "Naples",
    "Tallinn",
    "Cork",
)
_ASPECTS = ("history", "food", "harbor", "architecture", "weather")
TOPICS = tuple(f"the {aspect} of {city}" for aspect in _ASPECTS for city in _CITIES)  # 24 per concurrency
FOLLOW_UPS = (
    "Tell me about {topic}.",
    "Why is that so?",
    "Give me one example.",
    "How has it changed over time?",
    "What should a visitor see first?",
    "Summarise our conversation in one sentence.",
)
# distinct: --max-tokens. code_edit: the longest file given is 648 tokens, so the whole file, its fences and a line
# around them fit; rag_quote: a sentence and one of explanation; summarize: a paragraph.
WORKLOAD_MAX_TOKENS = {"shared_prefix": 64, "multi_turn": 48, "code_edit": 768, "rag_quote": 128, "summarize": 200}
GROUNDED_MIN_REQUESTS = 4  # a grounded phase at concurrency C sends max(4, 2 * C) requests: two per client from C=2
SWEEP_REQUESTS = 2  # the speculative sweep: requests per workload, at C=1 (multi_turn: one conversation, two turns)
# llama-server's draftless speculative settings, swept once before the rounds (flags of the vendored llama.cpp's
# common/arg.cpp; defaults: ngram-mod n-match 24, n-min 48, n-max 64, what its --spec-default sets; ngram-simple and
# ngram-map-k size-n 12, size-m 48, min-hits 1). The first is the default where the sweep is skipped.
SPEC_CANDIDATES = (
    "--spec-type ngram-mod",
    "--spec-type ngram-mod --spec-ngram-mod-n-match 16 --spec-ngram-mod-n-min 4 --spec-ngram-mod-n-max 24",
    "--spec-type ngram-simple",
    "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8",
    "--spec-type ngram-map-k",
)
DEFAULT_SPEC_CONFIG = SPEC_CANDIDATES[0]
READY_TIMEOUT = 120.0  # start-up and model load
STOP_TIMEOUT = 15.0  # SIGTERM -> exit, then SIGKILL
REQUEST_TIMEOUT = 120.0
POLL_INTERVAL = 0.1


# --------------------------------------------------------------------------------------------------------------
# Grounded documents: offline, deterministic for a given Python (the interpreter running the bench)
# --------------------------------------------------------------------------------------------------------------

# code_edit's files: slices of these standard-library modules, read as text from sysconfig's stdlib directory (never
# imported), in this order, at most CODE_PER_FILE from each, CODE_DOCUMENTS in all.
CODE_FILES = (
    "textwrap.py", "shlex.py", "calendar.py", "string.py", "shutil.py", "tempfile.py", "glob.py", "fnmatch.py",
    "difflib.py", "statistics.py", "heapq.py", "bisect.py", "copy.py", "pprint.py", "inspect.py", "subprocess.py",
    "ipaddress.py", "gettext.py", "locale.py", "tokenize.py", "ast.py", "dis.py", "base64.py", "quopri.py", "csv.py",
    "configparser.py", "getopt.py", "optparse.py", "zipfile.py", "tarfile.py", "mimetypes.py", "urllib/parse.py",
    "json/encoder.py", "json/decoder.py", "email/utils.py", "http/cookies.py", "colorsys.py", "wave.py", "platform.py",
    "sysconfig.py", "pkgutil.py", "linecache.py", "traceback.py", "warnings.py", "functools.py", "contextlib.py",
    "dataclasses.py", "enum.py", "typing.py", "weakref.py", "types.py", "operator.py", "numbers.py", "fractions.py",
    "random.py", "timeit.py", "trace.py", "pdb.py", "cmd.py", "code.py", "codeop.py", "doctest.py",
)  # fmt: skip
CODE_LINES = (45, 65)  # a slice: whole top-level functions and classes, consecutive, this many lines in all
CODE_CHARS = (1500, 2100)  # ... this many characters (346-648 tokens on SmolLM2's vocabulary), ASCII, no tabs
CODE_PER_FILE = 2
QUICK_CODE_LINES = 12  # --quick: each file's first lines only
CODE_DOCUMENTS = 64  # code_edit takes the even ones, code_edit_prediction the odd ones (32 each)
# rag_quote's and summarize's passages: the plain-prose paragraphs of pydoc's topics (pydoc_data.topics, the
# language reference's text that help() shows), topic by topic in name order, packed into passages of whole
# paragraphs, alternately one for summarize (SUMMARIZE_WORDS) and one for rag_quote (RAG_WORDS): no paragraph is in
# two passages.
SUMMARIZE_WORDS = (400, 650)
RAG_WORDS = (220, 380)


@dataclass(frozen=True)
class Document:
    """One grounded request's document and the user message built on it."""

    source: str  # where it comes from: "textwrap.py:373", "pydoc topic 'assignment'"
    prompt: str
    original: str = ""  # code_edit: the file as given (code_edit_prediction's prediction)


def code_slices(rel: str, text: str) -> list[Document]:
    """Up to ``CODE_PER_FILE`` slices of one module: runs of consecutive top-level functions and classes (with their
    decorators and whatever lies between them) spanning ``CODE_LINES`` lines and ``CODE_CHARS`` characters, each
    with the instruction to rename its first function or class."""
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    lo, hi = CODE_LINES
    out: list[Document] = []
    i = 0
    while i < len(nodes) and len(out) < CODE_PER_FILE:
        first = nodes[i]
        start = min([first.lineno, *(d.lineno for d in first.decorator_list)])
        end = None
        j = i
        while j < len(nodes) and (nodes[j].end_lineno or 0) - start + 1 <= hi:
            if (nodes[j].end_lineno or 0) - start + 1 >= lo:
                end = j
            j += 1
        if end is None:
            i += 1
            continue
        code = "\n".join(lines[start - 1 : nodes[end].end_lineno])
        if not (code.isascii() and "\t" not in code and CODE_CHARS[0] <= len(code) <= CODE_CHARS[1]):
            i += 1
            continue
        kind = "class" if isinstance(first, ast.ClassDef) else "function"
        renamed = f"{first.name}V2" if kind == "class" else f"{first.name}_v2"
        prompt = (
            f"Here is a Python file:\n\n```python\n{code}\n```\n\nRename the {kind} `{first.name}` to `{renamed}` and "
            "return the whole file, unchanged otherwise, in one ```python block."
        )
        out.append(Document(f"{rel}:{start}", prompt, code))
        i = end + 1
    return out


def quick_document(doc: Document) -> Document:
    """``--quick``: a code_edit file cut to its first ``QUICK_CODE_LINES`` lines (the definition its instruction
    names begins there): the prefill of a whole file is most of a smoke test's grounded phase. Other documents as
    they are."""
    if not doc.original:
        return doc
    code = "\n".join(doc.original.splitlines()[:QUICK_CODE_LINES])
    return Document(doc.source, doc.prompt.replace(doc.original, code, 1), code)


@functools.cache
def code_documents() -> tuple[Document, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    for rel in CODE_FILES:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        docs += code_slices(rel, text)
        if len(docs) >= CODE_DOCUMENTS:
            break
    return tuple(docs[:CODE_DOCUMENTS])


def prose_paragraphs(text: str) -> list[str]:
    """A pydoc topic's plain-prose paragraphs, each on one line: not its title, headings, indented code, grammar or
    tables, nor examples; bulleted paragraphs count as prose."""
    kept = []
    for para in re.split(r"\n\s*\n", text.strip("\n"))[1:]:  # the first is the topic's title
        lines = para.splitlines()
        bullet = lines[0].lstrip().startswith("* ")
        if not bullet and any(line.startswith(" ") for line in lines):
            continue
        if any("::=" in line or ">>>" in line for line in lines) or set(lines[-1].strip()) <= set("*=-~^"):
            continue
        if len(para.split()) >= 8:
            kept.append(" ".join(line.strip() for line in lines))
    return kept


@functools.cache
def prose_passages() -> dict[str, tuple[str, ...]]:
    """summarize's and rag_quote's passages (see ``SUMMARIZE_WORDS``); empty without ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return {"summarize": (), "rag_quote": ()}
    sizes = (("summarize", *SUMMARIZE_WORDS), ("rag_quote", *RAG_WORDS))
    out: dict[str, list[str]] = {"summarize": [], "rag_quote": []}
    turn = 0
    for key in sorted(topics):
        current: list[str] = []
        words = 0
        for para in prose_paragraphs(topics[key]):
            kind, lo, hi = sizes[turn % 2]
            n = len(para.split())
            if words + n > hi:
                if words >= lo:
                    out[kind].append("\n\n".join(current))
                    turn += 1
                current, words = [], 0
                if n > sizes[turn % 2][2]:
                    continue
            current.append(para)
            words += n
        kind, lo, _ = sizes[turn % 2]
        if words >= lo:
            out[kind].append("\n\n".join(current))
            turn += 1
    return {kind: tuple(passages) for kind, passages in out.items()}


def quote_question(passage: str) -> str:
    """rag_quote's question: which sentence holds a word found in no other sentence of the passage (the longest such
    word of at least 6 letters, in the sentence of at least 10 words nearest the middle)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(passage.split())) if s]
    lowered = [s.lower() for s in sentences]
    middle = len(sentences) // 2
    for i in sorted(range(len(sentences)), key=lambda k: (abs(k - middle), k)):
        if len(sentences[i].split()) < 10:
            continue
        for word in sorted(set(re.findall(r"[A-Za-z]{6,}", sentences[i])), key=lambda w: (-len(w), w)):
            pattern = re.compile(rf"\b{word.lower()}\b")
            if not any(pattern.search(other) for k, other in enumerate(lowered) if k != i):
                return (
                    f'Which sentence of the passage contains the word "{word}"? Quote that sentence exactly, then '
                    "explain it in one short sentence."
                )
    return "Quote the first sentence of the passage exactly, then explain it in one short sentence."


@functools.cache
def documents(name: str) -> tuple[Document, ...]:
    """A grounded workload's documents, in the order its phases take them."""
    if name in ("code_edit", PREDICTION):
        return code_documents()[0 if name == "code_edit" else 1 :: 2]
    passages = prose_passages()[name]
    if name == "summarize":
        return tuple(
            Document(f"pydoc passage {i}", f'Summarize the following text in one paragraph.\n\n"""\n{p}\n"""')
            for i, p in enumerate(passages)
        )
    return tuple(
        Document(
            f"pydoc passage {i}",
            f'Read the passage, then answer the question.\n\nPassage:\n"""\n{p}\n"""\n\nQuestion: {quote_question(p)}',
        )
        for i, p in enumerate(passages)
    )


def documents_needed(name: str, args: argparse.Namespace) -> int:
    """The documents a grounded workload's (or code_edit_prediction's) phases take in one server's run."""
    return sum(grounded_requests(c, args) for c in args.grounded_concurrency)


class ServerFailed(RuntimeError):
    """A server did not start (or did not list a model); ``tail`` is the end of its log."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail

    def one_line(self) -> str:
        last = " | ".join(line.strip() for line in self.tail.splitlines()[-3:] if line.strip())
        return f"{self}; log: {last}" if last else str(self)


# --------------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What the sides' command lines depend on, found once before the rounds."""

    model: Path
    llama_server: Path | None  # the binary, None when that side is skipped
    threads: int | None = THREADS  # None: each server's own default thread count (--cpu-hog)
    tether_args: tuple[str, ...] = ()  # --model, --chat-template, --deterministic: added to tether's command
    chat_template: str | None = None  # llama-server's --chat-template (a built-in name), with --chat-template
    spec_config: tuple[str, ...] = ()  # llama_server_spec's speculative flags (the sweep's choice or --spec-config)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` processes that busy-loop at normal priority until the block ends (killed and reaped then)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    if hogs:
        print(f"cpu hog: {count} busy-looping process(es) beside the servers", flush=True)
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick; a tiny race with other programs, harmless here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(side: str, setup: Setup, port: int) -> tuple[list[str], str]:
    """The command line and the readiness path of one side (see the module docstring for why each flag)."""
    if side in TETHER_SIDES:
        cmd = [sys.executable, "-m", "tether", "serve", "--port", str(port), "--n-ctx", str(N_CTX)]
        cmd += ["--threads", str(setup.threads)] if setup.threads else []
        cmd += ["--parallel", str(PARALLEL), *setup.tether_args]
        cmd += ["--speculation"] if side == "tether" else []  # tether_nospec: the default, speculation off
        return cmd, "/readyz"
    if side in LLAMA_SIDES:
        assert setup.llama_server is not None
        cmd = [str(setup.llama_server), "-m", str(setup.model), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(setup.threads), "-tb", str(setup.threads)] if setup.threads else []
        cmd += ["-c", str(PARALLEL * N_CTX), "-np", str(PARALLEL)]
        cmd += [
            "-b",
            str(N_BATCH),
            "-fa",
            "off",
            "--seed",
            str(SEED),
            "--temp",
            "0",
            "--no-webui",
            "--cache-reuse",
            "256",
        ]
        cmd += ["--chat-template", setup.chat_template] if setup.chat_template else []
        cmd += list(setup.spec_config) if side == "llama_server_spec" else []
        return cmd, "/health"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(setup.model), "--n_ctx", str(N_CTX)]
    if setup.threads:
        cmd += ["--n_threads", str(setup.threads), "--n_threads_batch", str(setup.threads)]
    cmd += ["--n_batch", str(N_BATCH)]
    cmd += ["--seed", str(SEED), "--interrupt_requests", "false", "--port", str(port), "--host", "127.0.0.1"]
    return cmd, "/v1/models"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Server:
    """One running server subprocess."""

    side: str
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path
    model_id: str = ""
    load_s: float = 0.0  # start -> ready
    leftover: int = 0  # set by stop_server
    forced: bool = False  # SIGKILL was needed


def wait_ready(server: Server, ready_path: str) -> None:
    """Poll the readiness path until 200 (bounded); then read the served model id."""
    began = time.monotonic()
    deadline = began + READY_TIMEOUT
    label = LABELS[server.side]
    with httpx.Client(base_url=server.base_url, timeout=5.0) as client:
        while True:
            if server.proc.poll() is not None:
                raise ServerFailed(
                    f"{label} exited with status {server.proc.returncode} before it was ready",
                    log_tail(server.log),
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(ready_path).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"{label} not ready after {READY_TIMEOUT:.0f} s ({ready_path} never returned 200)",
                    log_tail(server.log),
                )
            time.sleep(POLL_INTERVAL)
        server.load_s = time.monotonic() - began
        response = client.get("/v1/models")
        models = (response.json().get("data") or []) if response.status_code == 200 else []
        if not models:
            raise ServerFailed(f"{label} lists no model: GET /v1/models -> {response.status_code}")
        server.model_id = str(models[0]["id"])


def _alive(proc: psutil.Process) -> bool:
    """Still running (the same process: psutil checks its start time) and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_server(server: Server) -> tuple[int, bool]:
    """SIGTERM, wait (bounded), SIGKILL if needed; returns (leftover processes, whether SIGKILL was needed).

    Leftovers: the server's descendants snapshotted before the stop that still run after it, plus any process
    whose command line names ``tether.runner`` and this server (``--worker=PID``, or as its parent)."""
    try:
        before = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        before = []
    forced = False
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        forced = True
        server.proc.kill()
        server.proc.wait(STOP_TIMEOUT)
    # bounded grace for children that are exiting on their own right now (a lifeline EOF, a group kill in flight)
    deadline = time.monotonic() + 2.0
    alive = [p for p in before if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    pids = {p.pid for p in alive}
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        ours = proc.info["ppid"] == server.proc.pid or f"--worker={server.proc.pid}" in cmdline
        if ours and any("tether.runner" in arg for arg in cmdline):
            pids.add(proc.info["pid"])
    for pid in pids:  # leave nothing behind ourselves, whatever the figure says
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    return len(pids), forced


@contextlib.contextmanager
def running(side: str, setup: Setup, logdir: Path) -> Iterator[Server]:
    """Start one server, wait until it is ready, yield it, stop it (always)."""
    port = free_port()
    cmd, ready_path = server_command(side, setup, port)
    log = logdir / f"{side}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    server = Server(side, proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(server, ready_path)
        yield server
    finally:
        if proc.poll() is None:
            server.leftover, server.forced = stop_server(server)


# --------------------------------------------------------------------------------------------------------------
# Client load
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One streamed chat completion, as the client saw it."""

    prompt: int
    ttft: float | None = None  # seconds
    chunks: int = 0  # SSE chunks with non-empty content
    usage_tokens: int | None = None  # usage.completion_tokens, when the server sent it
    text: str = ""
    error: str | None = None
    stamps: list[float] = field(default_factory=list)  # perf_counter() of each content chunk
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # of them, those the server's prompt cache had (usage or llama-server timings)
    seq: int = 0  # its place in its phase (client i's request j: i * per_client + j): the same request on every side
    draft_tokens: int | None = None  # tether: usage.speculation.draft_tokens; llama-server: timings.draft_n
    accepted_tokens: int | None = None  # of them, those kept (llama-server: timings.draft_n_accepted)
    decode_steps: int | None = None  # tether: usage.speculation.decode_steps
    prediction_accepted: int | None = None  # usage.completion_tokens_details.accepted_prediction_tokens
    prediction_rejected: int | None = None  # usage.completion_tokens_details.rejected_prediction_tokens

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def gaps(self) -> list[float]:
        """Seconds between successive content chunks."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


STORY = {  # the json_schema variant's schema: the stories as JSON, long enough to run to max_tokens as plain ones do
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "story": {"type": "string", "minLength": STORY_MIN_CHARS},
    },
    "required": ["title", "story"],
}
VARIANTS: dict[str, dict[str, Any]] = {  # request fields per variant: the cost of each option on tokens/s
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}},
}
VARIANT_SIDES = ("tether", "llama_server")  # the batching servers (llama_cpp.server serves one at a time)


def chat_body(prompt: str, max_tokens: int, model: str) -> dict[str, Any]:
    """A greedy, seeded, streamed chat completion with usage: the request every bench here times."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def request_body(
    server: Server, prompt: str, max_tokens: int, variant: str = "plain", system: str = SYSTEM
) -> dict[str, Any]:
    body = chat_body(prompt, max_tokens, server.model_id)
    body["messages"][0]["content"] = system
    if server.side in ("baseline", "llama_server"):
        body["repeat_penalty"] = 1.0  # llama_cpp.server defaults to 1.1; tether's engine uses 1.0
    return body | VARIANTS[variant]


async def stream_one(
    client: httpx.AsyncClient, server: Server, index: int, max_tokens: int, variant: str = "plain"
) -> Request:
    """Send one streaming chat completion and read it to ``[DONE]``, stamping every content chunk."""
    req = Request(index)
    await read_stream(client, request_body(server, PROMPTS[index], max_tokens, variant), req)
    return req


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any], req: Request) -> float:
    """POST ``body`` (a streaming chat completion) and read it to ``[DONE]`` into ``req``: every content chunk
    stamped, the text, the usage, or the error. Returns when it was sent (``time.perf_counter()``)."""
    parts: list[str] = []
    done = False
    began = time.perf_counter()
    try:
        with anyio.fail_after(REQUEST_TIMEOUT):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    req.error = f"HTTP {response.status_code}: {response.text[:300]}"
                    return began
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": ping" comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        req.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                        return began
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        req.usage_tokens = int(usage["completion_tokens"])
                    if usage:
                        read_prompt_usage(usage, chunk.get("timings"), req)
                        read_speculation(usage, chunk.get("timings"), req)
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if req.ttft is None:
                                req.ttft = now - began
                            req.stamps.append(now)
                            req.chunks += 1
                            parts.append(content)
    except TimeoutError:
        req.error = f"no end of stream within {REQUEST_TIMEOUT:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        req.error = f"{type(exc).__name__}: {exc}"
    req.text = "".join(parts)
    if req.error is None and not done:
        req.error = "stream ended without data: [DONE]"
    elif req.error is None and req.chunks == 0:
        req.error = "no content"
    return began


def read_prompt_usage(usage: dict[str, Any], timings: dict[str, Any] | None, req: Request) -> None:
    """The prompt's tokens and how many the server's cache had: OpenAI's ``prompt_tokens_details.cached_tokens``
    (tether; llama-server too where it reports it), else llama-server's ``timings.cache_n``."""
    if usage.get("prompt_tokens") is not None:
        req.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        req.cached_tokens = int(details["cached_tokens"])
    elif timings and timings.get("cache_n") is not None:
        req.cached_tokens = int(timings["cache_n"])


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def read_speculation(usage: dict[str, Any], timings: dict[str, Any] | None, req: Request) -> None:
    """What speculative decoding did for this answer: tether's ``usage.speculation`` (``draft_tokens``,
    ``accepted_tokens``, ``decode_steps``) and ``usage.completion_tokens_details``' prediction tokens; llama-server's
    final ``timings`` (the usage chunk's), whose ``draft_n`` and ``draft_n_accepted`` it leaves out when it drafted
    nothing (0 then)."""
    spec = usage.get("speculation")
    if isinstance(spec, dict):
        req.draft_tokens = _count(spec.get("draft_tokens"))
        req.accepted_tokens = _count(spec.get("accepted_tokens"))
        req.decode_steps = _count(spec.get("decode_steps"))
    elif isinstance(timings, dict):
        req.draft_tokens = _count(timings.get("draft_n", 0))
        req.accepted_tokens = _count(timings.get("draft_n_accepted", 0))
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict):
        req.prediction_accepted = _count(details.get("accepted_prediction_tokens"))
        req.prediction_rejected = _count(details.get("rejected_prediction_tokens"))


@dataclass
class Load:
    """One load phase: C clients x N requests against one server."""

    concurrency: int
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests if r.error is None)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def ttft_ms(self, pct: int) -> float:
        return percentile([r.ttft * 1000.0 for r in self.requests if r.ttft is not None], pct)

    def itl_ms(self, pct: int) -> float:
        """A percentile of the gaps between content chunks, pooled over the phase's requests."""
        return percentile([g * 1000.0 for r in self.requests if r.error is None for g in r.gaps], pct)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.requests if r.error is not None)

    @property
    def prompt_counts(self) -> tuple[int, int]:
        """(cached, all) prompt tokens over the requests that reported both."""
        reported = [r for r in self.requests if r.prompt_tokens is not None and r.cached_tokens is not None]
        return sum(r.cached_tokens or 0 for r in reported), sum(r.prompt_tokens or 0 for r in reported)

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if r.error is None]


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding over some load phases, summed over their answered requests (each sum over the requests
    that reported that figure): drafted and accepted tokens, decode steps and the completion tokens of the requests
    that reported steps, the completion tokens of those that reported acceptance, prediction tokens kept and thrown
    away."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    step_tokens: int = 0
    draft_tokens_of: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    reported: bool = False  # any request reported drafts

    @classmethod
    def of(cls, loads: Sequence[Load]) -> SpecCounts:
        reqs = [r for load in loads for r in load.ok]
        drafting = [r for r in reqs if r.draft_tokens is not None and r.accepted_tokens is not None]
        stepping = [r for r in reqs if r.decode_steps]
        return cls(
            drafted=sum(r.draft_tokens or 0 for r in drafting),
            accepted=sum(r.accepted_tokens or 0 for r in drafting),
            steps=sum(r.decode_steps or 0 for r in stepping),
            step_tokens=sum(r.tokens for r in stepping),
            draft_tokens_of=sum(r.tokens for r in drafting),
            prediction_accepted=sum(r.prediction_accepted or 0 for r in reqs),
            prediction_rejected=sum(r.prediction_rejected or 0 for r in reqs),
            reported=bool(drafting),
        )

    @property
    def acceptance(self) -> float:
        """sum(accepted) / sum(drafted); nan when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Completion tokens / decode steps (tether's usage.speculation.decode_steps); nan without steps."""
        return self.step_tokens / self.steps if self.steps else float("nan")

    @property
    def derived_tokens_per_step(self) -> float:
        """Completion tokens / (completion tokens - accepted drafts): llama-server's steps, each one sampled token plus
        the drafts it kept (its timings give no step count); nan without reports."""
        steps = self.draft_tokens_of - self.accepted
        return self.draft_tokens_of / steps if self.reported and steps > 0 else float("nan")


def phase_client(server: Server, concurrency: int) -> httpx.AsyncClient:
    """One load phase's client: a keep-alive connection for every concurrent client."""
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    return httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT, limits=limits)


async def closed_loop_load(
    server: Server, concurrency: int, per_client: int, body_of: Callable[[int, int], tuple[int, dict[str, Any]]]
) -> Load:
    """A closed loop: each of ``concurrency`` clients sends ``per_client`` requests back to back; ``body_of(i, j)``
    is request ``j`` of client ``i``: its prompt's index and its body."""
    load = Load(concurrency)
    async with phase_client(server, concurrency) as client:

        async def send(i: int, j: int) -> None:
            index, body = body_of(i, j)
            req = Request(index, seq=i * per_client + j)
            await read_stream(client, body, req)
            load.requests.append(req)

        load.wall_s = await closed_loop(concurrency, per_client, send)
    return load


async def run_load(server: Server, concurrency: int, per_client: int, max_tokens: int, variant: str = "plain") -> Load:
    """``distinct`` (and its variants): ``PROMPTS`` in turn, in a closed loop."""

    def body_of(i: int, j: int) -> tuple[int, dict[str, Any]]:
        index = (i * per_client + j) % len(PROMPTS)
        return index, request_body(server, PROMPTS[index], max_tokens, variant)

    return await closed_loop_load(server, concurrency, per_client, body_of)


async def run_shared_prefix(server: Server, concurrency: int, phase: int, n: int, args: argparse.Namespace) -> Load:
    """``shared_prefix``: ``LONG_SYSTEM`` + a question of this phase's own 16, ``n`` per client in a closed loop."""
    per_phase = len(QUESTIONS) // len(CONCURRENCY)

    def body_of(i: int, j: int) -> tuple[int, dict[str, Any]]:
        index = (phase % len(CONCURRENCY)) * per_phase + (i * n + j) % per_phase
        tokens = args.workload_tokens["shared_prefix"]
        return index, request_body(server, QUESTIONS[index], tokens, system=LONG_SYSTEM)

    return await closed_loop_load(server, concurrency, n, body_of)


async def run_multi_turn(
    server: Server, concurrency: int, phase: int, conversations: int, turns: int, args: argparse.Namespace
) -> Load:
    """``multi_turn``: ``conversations`` conversations of ``turns`` turns, each turn the whole history (the server's
    own earlier answers included) and a follow-up. Client ``i`` holds the conversations ``k`` with ``k % C == i``
    and sends turn 1 of each, then turn 2 of each, ...: between two turns of a conversation the others run, so with
    more conversations than slots its cells have been overwritten (or saved) meanwhile."""
    load = Load(concurrency)
    topics = TOPICS[(phase % len(CONCURRENCY)) * conversations :][:conversations]
    histories: list[list[dict[str, str]]] = [[{"role": "system", "content": SYSTEM}] for _ in topics]

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        mine = [k for k in range(len(topics)) if k % concurrency == i]
        for turn in range(turns):
            for k in mine:
                question = FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(topic=topics[k])
                histories[k].append({"role": "user", "content": question})
                body = request_body(server, "", args.workload_tokens["multi_turn"])
                body["messages"] = list(histories[k])
                req = Request(k * turns + turn, seq=k * turns + turn)
                await read_stream(client, body, req)
                histories[k].append({"role": "assistant", "content": req.text})
                load.requests.append(req)

    async with phase_client(server, concurrency) as client:
        began = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(client_loop, client, i)
        load.wall_s = time.perf_counter() - began
    return load


def grounded_requests(concurrency: int, args: argparse.Namespace) -> int:
    """How many requests a grounded phase sends at this concurrency: max(4, 2 * C), one per client with --quick."""
    return concurrency if args.quick else max(GROUNDED_MIN_REQUESTS, 2 * concurrency)


def document_index(name: str, concurrency: int, k: int, args: argparse.Namespace) -> int:
    """The document of request ``k`` of the phase at this concurrency: each phase has its own, after those of the
    phases before it (``--concurrency``'s order), so no document repeats within a server's run (unless the pool is
    exhausted; ``documents`` in the JSON says whether it was)."""
    order = list(args.concurrency)
    before = order[: order.index(concurrency)] if concurrency in order else []
    return (sum(grounded_requests(c, args) for c in before) + k) % len(documents(name))


async def run_grounded(server: Server, name: str, concurrency: int, n: int, args: argparse.Namespace) -> Load:
    """``code_edit``, ``rag_quote``, ``summarize`` (and ``code_edit_prediction``): each request its own document,
    ``n`` per client in a closed loop. ``code_edit_prediction`` sends ``prediction`` = the original file to tether
    (speculation on); to ``tether --no-speculation`` the same requests without it (the reference texts)."""
    with_prediction = name == PREDICTION and server.side == "tether"
    tokens = args.workload_tokens[name]

    def body_of(i: int, j: int) -> tuple[int, dict[str, Any]]:
        index = document_index(name, concurrency, i * n + j, args)
        doc = documents(name)[index]
        doc = quick_document(doc) if args.quick else doc
        body = request_body(server, doc.prompt, tokens)
        if with_prediction:
            body["prediction"] = {"type": "content", "content": doc.original}
        return index, body

    return await closed_loop_load(server, concurrency, n, body_of)


async def run_phase(
    server: Server, name: str, concurrency: int, phase: int, args: argparse.Namespace, sweep: bool = False
) -> Load:
    """One load phase of a workload at one concurrency (``phase``: its index in ``--concurrency``, which picks the
    phase's own questions, topics and documents). ``sweep``: the speculative sweep's short phase at C=1."""
    if name == "distinct":
        n = SWEEP_REQUESTS if sweep else per_client(args.requests, concurrency)
        return await run_load(server, concurrency, n, args.max_tokens)
    if name == "shared_prefix":
        n = SWEEP_REQUESTS if sweep else per_client(args.requests, concurrency)
        return await run_shared_prefix(server, concurrency, phase, n, args)
    if name == "multi_turn":
        conversations, turns = (1, SWEEP_REQUESTS) if sweep else (args.conversations, args.turns)
        return await run_multi_turn(server, concurrency, phase, conversations, turns, args)
    n = SWEEP_REQUESTS if sweep else per_client(grounded_requests(concurrency, args), concurrency)
    return await run_grounded(server, name, concurrency, n, args)


def per_client(requests: int, concurrency: int) -> int:
    """N: each client's share of the ``requests`` sent at this concurrency (at least one)."""
    return max(1, requests // concurrency)


@dataclass
class Run:
    """One server's share of one round."""

    side: str
    round: int
    loads: dict[int, Load]
    load_s: float
    leftover: int = 0
    forced: bool = False
    warmup_error: str | None = None
    variants: dict[str, Load] = field(default_factory=dict)  # at the highest concurrency, one per --variants
    workloads: dict[str, dict[int, Load]] = field(default_factory=dict)  # every phase but distinct's: per C

    def workload(self, name: str) -> dict[int, Load]:
        """The load phases of a workload (or of ``code_edit_prediction``), per concurrency (``distinct``'s are
        ``loads``)."""
        return self.loads if name == "distinct" else self.workloads.get(name, {})


def side_phases(side: str, args: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """The phases a side runs, in order: each workload and its concurrencies. llama_cpp.server: ``distinct`` only.
    ``tether --no-speculation``: at ``--nospec-concurrency``. ``code_edit_prediction`` (tether's sides, after the
    workloads, when ``code_edit`` runs): at ``--prediction-concurrency``."""
    if side not in BATCHING_SIDES:
        return [("distinct", args.concurrency)]
    own = args.nospec_concurrency if side == "tether_nospec" else args.concurrency
    phases = [
        (
            name,
            tuple(c for c in args.concurrency if c in own and (name not in GROUNDED or c in args.grounded_concurrency)),
        )
        for name in args.workloads
    ]
    if side in TETHER_SIDES and "code_edit" in args.workloads:
        phases.append((PREDICTION, tuple(c for c in args.concurrency if c in own and c in args.prediction_concurrency)))
    return [(name, cs) for name, cs in phases if cs]


def describe_load(load: Load) -> str:
    """The progress line's figures for one load phase."""
    cached, prompt = load.prompt_counts
    spec = SpecCounts.of([load])
    drafts = f", accepted {spec.accepted}/{spec.drafted} drafted" if spec.drafted else ""
    steps = f", {spec.tokens_per_step:.2f} tokens/step" if spec.steps else ""
    predicted = (
        f", prediction kept {spec.prediction_accepted}, rejected {spec.prediction_rejected}"
        if spec.prediction_accepted or spec.prediction_rejected
        else ""
    )
    return (
        f"{len(load.requests)} request(s), {load.errors} error(s), {fmt(load.tokens_per_s)} tokens/s, TTFT p50 "
        f"{fmt(load.ttft_ms(50))} ms, prompt tokens cached {cached}/{prompt}{drafts}{steps}{predicted}"
    )


async def run_side(side: str, rnd: int, setup: Setup, logdir: Path, args: argparse.Namespace) -> Run:
    """One server's round: start, warm up, each workload at each concurrency in turn, stop (a progress line per
    phase)."""
    with running(side, setup, logdir) as server:
        print(f"round {rnd} {LABELS[side]}: ready in {server.load_s:.2f} s", flush=True)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as client:
            warm = await stream_one(client, server, 0, WARMUP_TOKENS)
        loads: dict[int, Load] = {}
        workloads: dict[str, dict[int, Load]] = {}
        for name, concurrencies in side_phases(side, args):
            phases = loads if name == "distinct" else workloads.setdefault(name, {})
            for phase, c in enumerate(args.concurrency):
                if c not in concurrencies:
                    continue
                phases[c] = load = await run_phase(server, name, c, phase, args)
                print(f"round {rnd} {LABELS[side]}: {name} C={c} {describe_load(load)}", flush=True)
        variants = {}
        top = max(args.concurrency)
        for variant in args.variants if side in VARIANT_SIDES else ():
            variants[variant] = load = await run_load(
                server, top, per_client(args.requests, top), args.max_tokens, variant
            )
            print(
                f"round {rnd} {LABELS[side]}: {variant} C={top} {load.errors} error(s), "
                f"{fmt(load.tokens_per_s)} tokens/s",
                flush=True,
            )
    return Run(side, rnd, loads, server.load_s, server.leftover, server.forced, warm.error, variants, workloads)


def round_order(sides: Sequence[str], rnd: int) -> list[str]:
    """The sides rotated by the round: each side leads in turn (two sides alternate)."""
    k = rnd % len(sides)
    return [*sides[k:], *sides[:k]]


def geomean(values: Sequence[float]) -> float:
    """The geometric mean; nan when a value is missing (nan) or not positive, or there is none."""
    if not values or any(not (v > 0) for v in values):
        return float("nan")
    return math.exp(statistics.fmean(math.log(v) for v in values))


async def spec_sweep(args: argparse.Namespace, setup: Setup, logdir: Path) -> list[dict[str, Any]]:
    """Each of ``SPEC_CANDIDATES`` once: a llama-server with those flags (and every other flag as the
    ``llama_server`` side), warmed up, then each of the run's workloads at C=1 with ``SWEEP_REQUESTS`` requests
    (multi_turn: one conversation of that many turns) at the workload's own max_tokens, the first of the C=1
    phase's prompts, questions or documents. One entry per configuration: its tokens/s and acceptance per workload,
    the geometric mean of the tokens/s, or why it did not run."""
    sweep: list[dict[str, Any]] = []
    for flags in SPEC_CANDIDATES:
        entry: dict[str, Any] = {"flags": flags, "tokens_per_s": {}, "acceptance": {}, "geomean": None, "error": None}
        began = time.monotonic()
        try:
            config = dataclasses.replace(setup, spec_config=tuple(shlex.split(flags)))
            with running("llama_server_spec", config, logdir) as server:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as client:
                    await stream_one(client, server, 0, WARMUP_TOKENS)
                for name in args.workloads:
                    load = await run_phase(server, name, 1, 0, args, sweep=True)
                    if load.errors:
                        first = next(r.error for r in load.requests if r.error)
                        entry["error"] = f"{load.errors} error(s) in {name}: {first}"
                    entry["tokens_per_s"][name] = rounded(load.tokens_per_s)
                    entry["acceptance"][name] = rounded(SpecCounts.of([load]).acceptance, 3)
        except ServerFailed as exc:
            entry["error"] = f"did not start: {exc.one_line()}"
        rates = [entry["tokens_per_s"].get(name) for name in args.workloads]
        if entry["error"] is None:
            entry["geomean"] = rounded(geomean([r if r is not None else float("nan") for r in rates]))
        entry["wall_s"] = round(time.monotonic() - began, 1)
        shown = ", ".join(f"{name} {entry['tokens_per_s'].get(name)}" for name in args.workloads)
        print(
            f"spec sweep: {flags}: tokens/s at C=1 {shown}; geomean {entry['geomean']}"
            + (f"; {entry['error']}" if entry["error"] else ""),
            flush=True,
        )
        sweep.append(entry)
    return sweep


def choose_spec_config(sweep: Sequence[dict[str, Any]]) -> str | None:
    """The sweep's configuration with the highest geometric mean of tokens/s (the first of equals); None when none
    ran cleanly."""
    ranked = [e for e in sweep if e["geomean"] is not None]
    return max(ranked, key=lambda e: e["geomean"])["flags"] if ranked else None


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


@dataclass(frozen=True)
class Figures:
    """One side at one concurrency: medians over the rounds (nan without runs)."""

    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p99_ms: float


def side_figures(runs: Sequence[Run], c: int, workload: str = "distinct") -> Figures:
    loads = [r.workload(workload)[c] for r in runs if c in r.workload(workload)]
    return Figures(
        median([load.tokens_per_s for load in loads]),
        median([load.ttft_ms(50) for load in loads]),
        median([load.ttft_ms(99) for load in loads]),
        median([load.itl_ms(99) for load in loads]),
    )


def rounded(value: float, digits: int = 1) -> float | None:
    return None if value != value else round(value, digits)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def outputs_identical(runs: Sequence[Run]) -> tuple[bool, int]:
    """Whether every prompt got the same completion text everywhere; and how many prompts did not."""
    by_prompt: dict[int, set[str]] = {}
    for run in runs:
        for load in run.loads.values():
            for req in load.requests:
                if req.error is None:
                    by_prompt.setdefault(req.prompt, set()).add(req.text)
    differing = sum(1 for seen in by_prompt.values() if len(seen) > 1)
    return differing == 0, differing


def all_loads(run: Run) -> Iterator[tuple[str, Load]]:
    """Every load phase of a run, with its workload's name (a variant's is its variant's)."""
    for name in PHASES:
        for load in run.workload(name).values():
            yield name, load
    for variant, load in run.variants.items():
        yield variant, load


def print_table(runs: Sequence[Run]) -> None:
    headers = ["round", "side", "workload", "C", "reqs", "errors", "chunks", "tokens", "wall s", "tok/s"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "cached", "accepted/drafted", "tok/step", "load s"]
    rows = []
    for run in runs:
        for name, load in all_loads(run):
            cached, prompt = load.prompt_counts
            spec = SpecCounts.of([load])
            rows.append(
                (
                    str(run.round),
                    LABELS[run.side],
                    name,
                    str(load.concurrency),
                    str(len(load.requests)),
                    str(load.errors),
                    str(sum(q.chunks for q in load.requests)),
                    str(load.tokens),
                    fmt(load.wall_s),
                    fmt(load.tokens_per_s),
                    fmt(load.ttft_ms(50)),
                    fmt(load.ttft_ms(99)),
                    fmt(load.itl_ms(99)),
                    f"{cached}/{prompt}",
                    f"{spec.accepted}/{spec.drafted}" if spec.reported else "-",
                    fmt(spec.tokens_per_step if spec.steps else spec.derived_tokens_per_step),
                    fmt(run.load_s),
                )
            )
    print_rows(headers, rows, left=2)


def null_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "serve", "tokens_per_s_ratio": None, "ttft_added_ms": None}
    result.update({"target_ratio": TARGET_RATIO, "meets_target": False, "quick": bool(args.quick)})
    result.update({"percentile": PERCENTILE, "skipped": None, "error": None, "llama_server_skipped": None})
    result.update({"llama_server_spec_skipped": None, "tether_nospec_skipped": None})
    result.update({"llama_server_spec_config": None, "llama_server_spec_config_source": None})
    result.update({"llama_server_spec_sweep": []})
    result.update(extra)
    return result


def locate_llama_server(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """The llama-server binary, or None and why: the cached one; else built, unless --quick or --no-build."""
    binary = llama_server.find()
    if binary is not None:
        return binary, None
    if args.quick or args.no_build:
        why = "--quick never builds" if args.quick else "--no-build was given"
        return None, (
            f"llama-server is not built ({llama_server.binary_path()} is missing or does not run) and {why}: "
            "build it with `.venv/bin/python bench/llama_server.py --build` (about 10 min on two cores) "
            "or a full run of bench/serve.py"
        )
    log = llama_server.default_log()
    print(f"building llama-server from llama.cpp (about 10 min on two cores); log: {log}", flush=True)
    try:
        binary = llama_server.build(log)
    except llama_server.BuildFailed as exc:
        print(f"llama-server skipped: {exc}")
        return None, f"llama-server could not be built: {str(exc).splitlines()[0]}"
    print(f"built {binary}")
    return binary, None


async def spec_configuration(
    args: argparse.Namespace, setup: Setup, logdir: Path
) -> tuple[str | None, str, list[dict[str, Any]]]:
    """llama_server_spec's flags, where they came from, and the sweep (empty where it was skipped)."""
    if args.spec_config is not None:
        return args.spec_config, "--spec-config", []
    if args.quick or args.no_spec_sweep:
        return DEFAULT_SPEC_CONFIG, "default (" + ("--quick" if args.quick else "--no-spec-sweep") + ")", []
    print(f"spec sweep: {len(SPEC_CANDIDATES)} llama-server configurations, each workload at C=1", flush=True)
    sweep = await spec_sweep(args, setup, logdir)
    return choose_spec_config(sweep), "sweep", sweep


async def bench(args: argparse.Namespace, setup: Setup, llama_skipped: str | None) -> dict[str, Any]:
    began = time.monotonic()
    runs: list[Run] = []
    skipped: dict[str, str | None] = dict.fromkeys(OPTIONAL_SIDES)
    skipped["llama_server"] = llama_skipped
    sides = [side for side in SIDES if side in args.sides]
    if setup.llama_server is None:
        skipped["llama_server_spec"] = llama_skipped
        sides = [side for side in sides if side not in LLAMA_SIDES]
    sweep: list[dict[str, Any]] = []
    spec_flags: str | None = None
    spec_source: str | None = None
    with tempfile.TemporaryDirectory(prefix="tether-bench-serve-") as tmp:
        if "llama_server_spec" in sides:
            spec_flags, spec_source, sweep = await spec_configuration(args, setup, Path(tmp))
            if spec_flags is None:
                skipped["llama_server_spec"] = "no configuration of the speculative sweep ran without errors"
                sides.remove("llama_server_spec")
            else:
                setup = dataclasses.replace(setup, spec_config=tuple(shlex.split(spec_flags)))
                print(f"llama-server speculative: {spec_flags} ({spec_source})", flush=True)
        sweep_s = time.monotonic() - began
        for rnd in range(args.rounds):
            for side in round_order(sides, rnd):
                try:
                    runs.append(await run_side(side, rnd, setup, Path(tmp), args))
                except ServerFailed as exc:
                    if side not in OPTIONAL_SIDES:
                        raise
                    print(f"{LABELS[side]} skipped: {exc}; its log ends with:\n{exc.tail}")
                    skipped[side] = f"{LABELS[side]} did not start: {exc.one_line()}"
                    sides.remove(side)  # not in the later rounds; its earlier runs are dropped
                    runs = [r for r in runs if r.side != side]
    wall_s = time.monotonic() - began

    gone = "; ".join(f"{LABELS[side]} skipped: {why}" for side, why in skipped.items() if why and side in args.sides)
    print(
        f"tether serve on {setup.model.name}, sides {', '.join(LABELS[side] for side in sides)}: {args.rounds} "
        f"round(s), concurrency {list(args.concurrency)}, workloads {', '.join(args.workloads)}, distinct's "
        f"{args.requests} request(s) per concurrency and max_tokens {args.max_tokens}, tether --parallel {PARALLEL} "
        f"({wall_s:.1f} s, the sweep {sweep_s:.1f} s){' (quick)' if args.quick else ''}" + (f"; {gone}" if gone else "")
    )
    print_table(runs)

    by_side = {side: [r for r in runs if r.side == side] for side in SIDES}
    result = null_result(
        args,
        llama_server_skipped=skipped["llama_server"],
        llama_server_spec_skipped=skipped["llama_server_spec"],
        tether_nospec_skipped=skipped["tether_nospec"],
        llama_server_spec_config=spec_flags,
        llama_server_spec_config_source=spec_source,
        llama_server_spec_sweep=sweep,
    )
    ratios: dict[int, float] = {}
    added: dict[int, float] = {}
    for c in args.concurrency:
        figs = {side: side_figures(by_side[side], c) for side in SIDES}
        t, b, ls = figs["tether"], figs["baseline"], figs["llama_server"]
        ratios[c] = ratio(t.tokens_per_s, b.tokens_per_s)
        added[c] = t.ttft_p50_ms - b.ttft_p50_ms
        for side, f in figs.items():
            result[f"{side}_tokens_per_s_c{c}"] = rounded(f.tokens_per_s)
            result[f"{side}_ttft_p50_ms_c{c}"] = ms(f.ttft_p50_ms)
            result[f"{side}_ttft_p99_ms_c{c}"] = ms(f.ttft_p99_ms)
            result[f"{side}_itl_p99_ms_c{c}"] = ms(f.itl_p99_ms)
        result[f"tokens_per_s_ratio_c{c}"] = rounded(ratios[c], 3)
        result[f"ttft_added_ms_c{c}"] = ms(added[c])
        result[f"tokens_per_s_ratio_vs_llama_server_c{c}"] = rounded(ratio(t.tokens_per_s, ls.tokens_per_s), 3)
    result["ttft_p50_ms_c8"] = result.get("tether_ttft_p50_ms_c8")
    result.setdefault("llama_server_ttft_p50_ms_c8", None)
    headline_ratio = min(ratios.values()) if all(v == v for v in ratios.values()) else float("nan")
    first = min(args.concurrency)
    result["tokens_per_s_ratio"] = rounded(headline_ratio, 3)
    result["ttft_added_ms"] = ms(added[first])
    result["meets_target"] = bool(headline_ratio == headline_ratio and headline_ratio >= TARGET_RATIO)
    identical, differing = outputs_identical(by_side["baseline"] + by_side["tether"])
    ls_identical: bool | None = None
    ls_differing: int | None = None
    if by_side["llama_server"]:
        ls_identical, ls_differing = outputs_identical(by_side["llama_server"] + by_side["tether"])
    top = max(args.concurrency)
    for variant in args.variants:
        for side in VARIANT_SIDES:
            rates = [r.variants[variant].tokens_per_s for r in by_side[side] if variant in r.variants]
            plain = result.get(f"{side}_tokens_per_s_c{top}")
            rate = median(rates) if rates else float("nan")
            result[f"{side}_tokens_per_s_{variant}_c{top}"] = rounded(rate)
            result[f"{side}_{variant}_vs_plain_c{top}"] = rounded(ratio(rate, plain or float("nan")), 3)
        result[f"tokens_per_s_ratio_vs_llama_server_{variant}_c{top}"] = rounded(
            ratio(
                result[f"tether_tokens_per_s_{variant}_c{top}"] or float("nan"),
                result[f"llama_server_tokens_per_s_{variant}_c{top}"] or float("nan"),
            ),
            3,
        )
    add_workload_figures(result, by_side, args)
    add_speculation_figures(result, by_side, args)
    errors_by_side = {
        side: sum(load.errors for r in rs for _, load in all_loads(r)) + sum(1 for r in rs if r.warmup_error)
        for side, rs in by_side.items()
    }
    errors = sum(errors_by_side.values())
    leftover = sum(r.leftover for side in TETHER_SIDES for r in by_side[side])
    sources = {
        side: sorted({"usage" if q.usage_tokens is not None else "chunks" for r in rs for q in _requests(r)})
        for side, rs in by_side.items()
    }
    grounded = [
        name for name in (*GROUNDED, PREDICTION) if name in {n for side in sides for n, _ in side_phases(side, args)}
    ]
    result.update(
        {
            "headline": f"tokens_per_s_ratio: min over concurrency {list(args.concurrency)}; "
            f"ttft_added_ms: concurrency {first}",
            "errors": errors,
            "errors_by_side": errors_by_side,
            "leftover_processes": leftover,
            "forced_kills": sum(1 for r in runs if r.forced),
            "outputs_identical": identical,
            "prompts_with_differing_outputs": differing,
            "llama_server_outputs_identical": ls_identical,
            "llama_server_prompts_with_differing_outputs": ls_differing,
            "tokens_source": {side: "+".join(s) for side, s in sources.items() if s},
            **{f"{side}_load_s": rounded(median([r.load_s for r in by_side[side]]), 2) for side in SIDES},
            "llama_server_version": llama_server.version(setup.llama_server) if setup.llama_server else None,
            "tether_parallel": PARALLEL,
            "llama_server_parallel": PARALLEL,
            "sides": sides,
            "workloads": list(args.workloads),
            "concurrency": list(args.concurrency),
            "nospec_concurrency": [c for c in args.concurrency if c in args.nospec_concurrency],
            "prediction_concurrency": [c for c in args.concurrency if c in args.prediction_concurrency],
            "grounded_concurrency": [c for c in args.concurrency if c in args.grounded_concurrency],
            "rounds": args.rounds,
            "requests_per_concurrency": args.requests,
            "requests_per_client": {str(c): per_client(args.requests, c) for c in args.concurrency},
            "grounded_requests": {str(c): grounded_requests(c, args) for c in args.concurrency},
            "requests_per_side": sum(len(load.requests) for r in by_side["tether"] for load in r.loads.values()),
            "max_tokens": args.max_tokens,
            "workload_max_tokens": dict(args.workload_tokens),
            "documents": {
                name: {"available": len(documents(name)), "needed": documents_needed(name, args)} for name in grounded
            },
            "documents_python": platform.python_version(),
            "model": setup.model.name,
            "deterministic": args.deterministic,
            "threads": setup.threads,
            "cpu_hog": args.cpu_hog,
            "n_ctx": N_CTX,
            "sweep_s": round(sweep_s, 1),
            "wall_s": round(wall_s, 1),
        }
    )
    print(f"percentiles: {PERCENTILE}; per side: the median over the rounds")
    for c in args.concurrency:
        vs_cpp = (
            f"; tokens/s tether/llama-server = {result[f'tokens_per_s_ratio_vs_llama_server_c{c}']}, "
            f"TTFT p50 tether {result[f'tether_ttft_p50_ms_c{c}']} ms vs llama-server "
            f"{result[f'llama_server_ttft_p50_ms_c{c}']} ms"
            if by_side["llama_server"]
            else ""
        )
        print(
            f"C={c}: tokens/s tether/llama_cpp.server = {result[f'tokens_per_s_ratio_c{c}']}, "
            f"TTFT p50 added = {result[f'ttft_added_ms_c{c}']} ms{vs_cpp}"
        )
    print_speculation_summary(result, args)
    print(
        f"headline: tokens/s ratio {result['tokens_per_s_ratio']} (target {TARGET_RATIO}: "
        f"{'met' if result['meets_target'] else 'NOT met'}), TTFT added {result['ttft_added_ms']} ms at C={first}; "
        f"outputs identical: {identical} (llama_cpp.server), {ls_identical} (llama-server); greedy texts that "
        f"differ with speculation on: {result['speculation_divergent_texts']} of "
        f"{result['speculation_compared_texts']} (tether), {result['llama_server_speculation_divergent_texts']} of "
        f"{result['llama_server_speculation_compared_texts']} (llama-server)"
    )
    if errors or leftover:
        print(f"FAILURE: {errors} request error(s), {leftover} leftover process(es) after tether serve stopped")
        for r in runs:
            if r.warmup_error:
                print(f"  round {r.round} {LABELS[r.side]} warm-up: {r.warmup_error}")
            for name, load in all_loads(r):
                for q in load.requests:
                    if q.error:
                        print(
                            f"  round {r.round} {LABELS[r.side]} {name} C={load.concurrency} request {q.seq} "
                            f"(prompt {q.prompt}): {q.error}"
                        )
    return result


def _requests(run: Run) -> Iterator[Request]:
    for _, load in all_loads(run):
        yield from (q for q in load.requests if q.error is None)


def phase_loads(runs: Sequence[Run], name: str, c: int) -> list[Load]:
    """A workload's load phases at one concurrency, one per round that ran it."""
    return [r.workload(name)[c] for r in runs if c in r.workload(name)]


def add_workload_figures(result: dict[str, Any], by_side: dict[str, list[Run]], args: argparse.Namespace) -> None:
    """The per-workload keys of every batching side, tether's ratios to llama-server and to its speculative setting
    (see the module docstring), and how often a greedy text differed between a side's own phases of ``distinct``
    (the same prompts, other cache states and neighbours)."""
    top = max(args.concurrency)
    for name in args.workloads:
        for c in args.concurrency:
            figs = {side: side_figures(by_side[side], c, name) for side in BATCHING_SIDES}
            rate = {side: f.tokens_per_s for side, f in figs.items()}
            result[f"tokens_per_s_ratio_vs_llama_server_{name}_c{c}"] = rounded(
                ratio(rate["tether"], rate["llama_server"]), 3
            )
            result[f"tokens_per_s_ratio_vs_llama_server_spec_{name}_c{c}"] = rounded(
                ratio(rate["tether"], rate["llama_server_spec"]), 3
            )
            result[f"speculation_speedup_{name}_c{c}"] = rounded(ratio(rate["tether"], rate["tether_nospec"]), 3)
            result[f"llama_server_speculation_speedup_{name}_c{c}"] = rounded(
                ratio(rate["llama_server_spec"], rate["llama_server"]), 3
            )
            for side, f in figs.items():
                prefix = KEY_PREFIX[side]
                result[f"{prefix}tokens_per_s_{name}_c{c}"] = rounded(f.tokens_per_s)
                result[f"{prefix}ttft_p50_ms_{name}_c{c}"] = ms(f.ttft_p50_ms)
                result[f"{prefix}itl_p99_ms_{name}_c{c}"] = ms(f.itl_p99_ms)
        for side in BATCHING_SIDES:
            counts = [load.prompt_counts for r in by_side[side] for load in r.workload(name).values()]
            cached, prompt = sum(c for c, _ in counts), sum(p for _, p in counts)
            share = rounded(cached / prompt, 3) if prompt else None
            result[f"{KEY_PREFIX[side]}prefix_hit_tokens_share_{name}"] = share
    for side, prefix in (("tether", ""), ("llama_server", "llama_server_")):
        differing = outputs_identical(by_side[side])[1] if by_side[side] else None
        result[f"{prefix}distinct_prompts_differing_across_phases"] = differing
    if "json_schema" in args.variants:
        result["json_schema_over_plain"] = result.get(f"tether_json_schema_vs_plain_c{top}")
        result["llama_server_json_schema_over_plain"] = result.get(f"llama_server_json_schema_vs_plain_c{top}")


def texts_by_request(runs: Sequence[Run], names: Sequence[str]) -> dict[tuple[int, str, int, int], str]:
    """Every answered request's completion text, by (round, workload, concurrency, its place in its phase)."""
    return {
        (r.round, name, c, q.seq): q.text
        for r in runs
        for name in names
        for c, load in r.workload(name).items()
        for q in load.ok
    }


def divergent_texts(a: Sequence[Run], b: Sequence[Run], names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per workload: (requests whose text differs between two sides, requests both sides answered)."""
    ta, tb = texts_by_request(a, names), texts_by_request(b, names)
    both = [key for key in ta if key in tb]
    return {
        name: (sum(1 for k in both if k[1] == name and ta[k] != tb[k]), sum(1 for k in both if k[1] == name))
        for name in names
    }


def add_speculation_figures(result: dict[str, Any], by_side: dict[str, list[Run]], args: argparse.Namespace) -> None:
    """Acceptance and tokens per step per workload and concurrency (tether; llama-server's speculative setting),
    code_edit's prediction phase against its plain one, and the greedy texts that speculation changed."""
    for name in args.workloads:
        for c in args.concurrency:
            spec = SpecCounts.of(phase_loads(by_side["tether"], name, c))
            result[f"acceptance_{name}_c{c}"] = rounded(spec.acceptance, 3)
            result[f"tokens_per_step_{name}_c{c}"] = rounded(spec.tokens_per_step, 3)
            result[f"draft_tokens_{name}_c{c}"] = spec.drafted if spec.reported else None
            ls = SpecCounts.of(phase_loads(by_side["llama_server_spec"], name, c))
            result[f"llama_server_spec_acceptance_{name}_c{c}"] = rounded(ls.acceptance, 3)
            result[f"llama_server_spec_tokens_per_step_{name}_c{c}"] = rounded(ls.derived_tokens_per_step, 3)
            result[f"llama_server_spec_draft_tokens_{name}_c{c}"] = ls.drafted if ls.reported else None
    if "code_edit" in args.workloads:
        for c in args.concurrency:
            loads = phase_loads(by_side["tether"], PREDICTION, c)
            predicted = side_figures(by_side["tether"], c, PREDICTION)
            plain = side_figures(by_side["tether"], c, "code_edit")
            reference = side_figures(by_side["tether_nospec"], c, PREDICTION)
            ls_spec = side_figures(by_side["llama_server_spec"], c, "code_edit")
            spec = SpecCounts.of(loads)
            result[f"tokens_per_s_{PREDICTION}_c{c}"] = rounded(predicted.tokens_per_s)
            result[f"ttft_p50_ms_{PREDICTION}_c{c}"] = ms(predicted.ttft_p50_ms)
            result[f"itl_p99_ms_{PREDICTION}_c{c}"] = ms(predicted.itl_p99_ms)
            result[f"tether_nospec_tokens_per_s_{PREDICTION}_c{c}"] = rounded(reference.tokens_per_s)
            result[f"prediction_speedup_code_edit_c{c}"] = rounded(ratio(predicted.tokens_per_s, plain.tokens_per_s), 3)
            result[f"prediction_speedup_vs_nospec_code_edit_c{c}"] = rounded(
                ratio(predicted.tokens_per_s, reference.tokens_per_s), 3
            )
            result[f"tokens_per_s_ratio_vs_llama_server_spec_{PREDICTION}_c{c}"] = rounded(
                ratio(predicted.tokens_per_s, ls_spec.tokens_per_s), 3
            )
            result[f"prediction_accepted_tokens_code_edit_c{c}"] = spec.prediction_accepted if loads else None
            result[f"prediction_rejected_tokens_code_edit_c{c}"] = spec.prediction_rejected if loads else None
            shown = spec.prediction_accepted + spec.prediction_rejected
            result[f"prediction_acceptance_code_edit_c{c}"] = (
                rounded(spec.prediction_accepted / shown, 3) if shown else None
            )
            result[f"acceptance_{PREDICTION}_c{c}"] = rounded(spec.acceptance, 3)
            result[f"tokens_per_step_{PREDICTION}_c{c}"] = rounded(spec.tokens_per_step, 3)
    names = [*args.workloads, *([PREDICTION] if "code_edit" in args.workloads else [])]
    for label, (a, b), keyed in (
        ("speculation", ("tether", "tether_nospec"), names),
        ("llama_server_speculation", ("llama_server_spec", "llama_server"), list(args.workloads)),
    ):
        counts = divergent_texts(by_side[a], by_side[b], keyed)
        for name, (differ, compared) in counts.items():
            result[f"{label}_divergent_texts_{name}"] = differ if compared else None
        compared = sum(n for _, n in counts.values())
        result[f"{label}_divergent_texts"] = sum(d for d, _ in counts.values()) if compared else None
        result[f"{label}_compared_texts"] = compared


def print_speculation_summary(result: dict[str, Any], args: argparse.Namespace) -> None:
    """One row per workload and concurrency: each batching side's tokens/s, tether's ratios, speculation's
    acceptance and tokens per step (tether; llama-server's speculative setting)."""
    headers = ["workload", "C", "tether", "nospec", "llama-server", "ls spec", "vs ls", "vs ls spec", "tether spd"]
    headers += ["acc", "tok/step", "ls spec acc", "ls tok/step"]
    names = [*args.workloads, *([PREDICTION] if "code_edit" in args.workloads else [])]

    def show(key: str) -> str:
        value = result.get(key)
        return "-" if value is None else str(value)

    rows = []
    for name in names:
        for c in args.concurrency:
            ls_name = "code_edit" if name == PREDICTION else name
            rows.append(
                (
                    name,
                    str(c),
                    show(f"tokens_per_s_{name}_c{c}"),
                    show(f"tether_nospec_tokens_per_s_{name}_c{c}"),
                    show(f"llama_server_tokens_per_s_{ls_name}_c{c}"),
                    show(f"llama_server_spec_tokens_per_s_{ls_name}_c{c}"),
                    show(f"tokens_per_s_ratio_vs_llama_server_{name}_c{c}"),
                    show(f"tokens_per_s_ratio_vs_llama_server_spec_{name}_c{c}"),
                    show(
                        f"prediction_speedup_code_edit_c{c}"
                        if name == PREDICTION
                        else f"speculation_speedup_{name}_c{c}"
                    ),
                    show(f"acceptance_{name}_c{c}"),
                    show(f"tokens_per_step_{name}_c{c}"),
                    show(f"llama_server_spec_acceptance_{ls_name}_c{c}"),
                    show(f"llama_server_spec_tokens_per_step_{ls_name}_c{c}"),
                )
            )
    print(
        "tokens/s per workload (medians over the rounds); vs ls / vs ls spec: tether over llama-server's default and "
        "its speculative setting; tether spd: tether over tether --no-speculation (code_edit_prediction: over "
        "tether's plain code_edit); acc: accepted/drafted"
    )
    print_rows(headers, rows, left=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds, each running every server, the order rotating; figures are medians over them (default 1)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=REQUESTS,
        help=f"R: distinct's and shared_prefix's requests per concurrency C, R // C per client (default {REQUESTS}; "
        "the grounded workloads send max(4, 2 * C))",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help=f"distinct's, per request (default {MAX_TOKENS})"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="client counts (default 1 4 8; --quick: 1 2)"
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=None,
        help="servers to run: tether (--speculation), tether_nospec (speculation off, the default), llama_server "
        "(its defaults), llama_server_spec (its draftless speculation, the sweep's choice), baseline "
        "(llama_cpp.server); default all but baseline (--quick: all five); a side left out has null figures",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=[v for v in VARIANTS if v != "plain"],
        default=None,
        help="after the load phases, the highest concurrency again with each option on (tether and llama-server): "
        "logprobs (top 5), json_schema (the stories as JSON); default json_schema (--quick: none)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=None,
        help="the batching servers' workloads: the controls distinct, shared_prefix, multi_turn and the grounded "
        "code_edit (with its prediction phase on tether's sides), rag_quote, summarize (default all six; --quick: "
        "distinct and code_edit, at C=1; llama_cpp.server runs distinct only)",
    )
    parser.add_argument(
        "--spec-config",
        default=None,
        metavar="FLAGS",
        help='llama_server_spec\'s speculative flags, e.g. "--spec-type ngram-mod --spec-ngram-mod-n-max 32" '
        "(only --spec-* flags): no sweep (reuse a sweep's llama_server_spec_config)",
    )
    parser.add_argument(
        "--no-spec-sweep",
        action="store_true",
        help=f'no sweep: llama_server_spec runs "{DEFAULT_SPEC_CONFIG}" (llama.cpp\'s --spec-default values)',
    )
    parser.add_argument(
        "--nospec-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="the concurrencies tether_nospec runs (default all of --concurrency; 1 saves about 6 min)",
    )
    parser.add_argument(
        "--prediction-concurrency",
        type=int,
        nargs="*",
        default=None,
        help="the concurrencies of code_edit's prediction phase on tether's sides (default all of --concurrency; "
        "--quick: the lowest; the flag alone: no prediction phase)",
    )
    parser.add_argument(
        "--no-build", action="store_true", help="do not build llama-server when it is missing (skip its sides)"
    )
    parser.add_argument(
        "--cpu-hog",
        action="store_true",
        help="a busy-looping process per core beside the servers for the whole run, and every server at its own "
        "default thread count (a shared machine: what a user gets without tuning)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"1 round, R={QUICK_REQUESTS}, {QUICK_MAX_TOKENS} tokens ({QUICK_MAX_TOKENS // 2} in the other "
        f"workloads), 1 thread, concurrency 1 2, one grounded request at C=1 only (a file's first "
        f"{QUICK_CODE_LINES} lines), no sweep, no build (CI)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME|FILE",
        help="a pulled model's name (tether pull --list) or a GGUF file (default: the built-in model)",
    )
    parser.add_argument(
        "--chat-template", default=None, metavar="NAME", help="a built-in chat template, for a GGUF without one"
    )
    parser.add_argument("--deterministic", action="store_true", help="tether serves with --deterministic")
    parser.add_argument(
        "--conversations",
        dest="conversations_flag",
        type=int,
        default=None,
        help=f"multi_turn's conversations (default {CONVERSATIONS}; --quick: {QUICK_CONVERSATIONS})",
    )
    parser.add_argument(
        "--turns",
        dest="turns_flag",
        type=int,
        default=None,
        help=f"multi_turn's turns (default {TURNS}; --quick: {QUICK_TURNS})",
    )
    args = parser.parse_args(argv)
    args.conversations, args.turns = CONVERSATIONS, TURNS
    args.workload_tokens = dict(WORKLOAD_MAX_TOKENS)
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, QUICK_REQUESTS, QUICK_MAX_TOKENS
        args.conversations, args.turns = QUICK_CONVERSATIONS, QUICK_TURNS
        args.workload_tokens = dict.fromkeys(WORKLOAD_MAX_TOKENS, QUICK_MAX_TOKENS // 2)
    args.workload_tokens[PREDICTION] = args.workload_tokens["code_edit"]
    args.conversations = args.conversations_flag or args.conversations
    args.turns = args.turns_flag or args.turns
    if args.workloads is None:
        args.workloads = list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    args.workloads = list(dict.fromkeys(args.workloads))  # in the order given, each once
    if args.sides is None:
        # --quick: llama-server's speculative side is left out (the smoke test's time, on CI's loaded cores)
        args.sides = [s for s in SIDES if s != "llama_server_spec"] if args.quick else list(BATCHING_SIDES)
    if args.variants is None:
        args.variants = [] if args.quick else ["json_schema"]
    if args.concurrency is None:
        args.concurrency = list(QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --requests, --max-tokens and --concurrency must be at least 1")
    args.concurrency = tuple(dict.fromkeys(args.concurrency))  # each once, in the order given
    if args.nospec_concurrency is None:
        args.nospec_concurrency = (min(args.concurrency),) if args.quick else args.concurrency
    if args.prediction_concurrency is None:
        args.prediction_concurrency = (min(args.concurrency),) if args.quick else args.concurrency
    # --quick: a grounded phase at the lowest concurrency only (its prefill is the quick run's longest wait; the
    # batch path is distinct's)
    args.grounded_concurrency = (min(args.concurrency),) if args.quick else args.concurrency
    if args.spec_config is not None:
        flags = shlex.split(args.spec_config)
        if not flags or any(f.startswith("-") and not f.startswith("--spec-") for f in flags):
            parser.error(f"--spec-config takes llama-server's --spec-* flags only: {args.spec_config!r}")
        args.spec_config = shlex.join(flags)
    for name in [*args.workloads, *([PREDICTION] if "code_edit" in args.workloads else [])]:
        if name in (*GROUNDED, PREDICTION) and not documents(name):
            parser.error(f"no documents for {name} in this Python's standard library (pydoc_data or its modules)")
    try:
        model = default_model_path() if args.model is None else named_or_file(args.model)
    except InvalidModel as exc:
        print(f"skipped: {exc}")
        emit(null_result(args, skipped=str(exc)))
        return 0
    binary, llama_skipped = (
        locate_llama_server(args) if set(args.sides) & set(LLAMA_SIDES) else (None, None)
    )  # neither llama-server side asked for: nothing to find or build
    tether_args: tuple[str, ...] = ("--model", str(model)) if args.model else ()
    tether_args += ("--deterministic",) if args.deterministic else ()
    tether_args += ("--chat-template", args.chat_template) if args.chat_template else ()
    threads = None if args.cpu_hog else QUICK_THREADS if args.quick else THREADS
    setup = Setup(model, binary, threads, tether_args, args.chat_template)
    with private_tether_dirs("tether-bench-serve-"), cpu_hogs((os.cpu_count() or 1) if args.cpu_hog else 0):
        try:
            result = anyio.run(bench, args, setup, llama_skipped)
        except ServerFailed as exc:
            print(f"FAILURE: {exc}; its log ends with:\n{exc.tail}")
            emit(null_result(args, error=exc.one_line(), llama_server_skipped=llama_skipped))
            return 1
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
