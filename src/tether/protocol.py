"""Typed messages between a supervisor and its runner.

Everything that crosses the process boundary is a msgspec struct in a tagged union, so a frame decodes straight
into the right type (or fails loudly as a protocol error). Tasks flow supervisor -> runner; events flow runner ->
supervisor. ``Failed`` is a status only the supervisor sets: a runner cannot be trusted to report its own death.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tether.errors import InvalidField


def documented(**schema: Any) -> msgspec.Meta:
    """JSON Schema for ``/openapi.json`` only, where a struct's own check enforces it with a message that says why
    (msgspec's constraint errors would not); the API fuzzer proves the schema and the check agree."""
    return msgspec.Meta(extra_json_schema=schema)


# --------------------------------------------------------------------------------------------------------------
# Faults (debug engine): declared here because they travel inside tasks and engine specs.
# --------------------------------------------------------------------------------------------------------------

FaultKind = Literal[
    "raise",  # raise RuntimeError (an unexpected engine exception: fatal for the runner)
    "request_error",  # raise RequestError: the engine refuses this request alone; the runner (and its batch) serve on
    "exit",  # os._exit(code), code 0 included
    "segv",  # SIGSEGV via a real invalid memory read (faulthandler prints the stack)
    "abort",  # SIGABRT via abort()
    "sigkill",  # SIGKILL to itself: what the OOM killer or `kill -9` does, minus the cause
    "memory_error",  # raise MemoryError
    "oom",  # allocate and touch memory until the kernel kills the process
    "hang",  # loop forever in Python (GIL released between bytecodes: heartbeat keeps going)
    "hang_gil",  # block forever in native code holding the GIL (heartbeat stops too)
    "stall_at_limit",  # fill its memory cgroup to just under its limit, then block as hang_gil: a stall at the limit
    "slow",  # sleep `seconds` before every token / load step
    "stderr_flood",  # write `lines` lines to stderr
    "ignore_sigterm",  # ignore SIGTERM from now on (to prove stop escalates to SIGKILL)
    "garbage",  # write bytes that are no frame to the events pipe (a length prefix of `size`), then carry on
]
# "idle": fires from a background thread ``seconds`` after warmup, while the runner waits for requests (as a native
# engine thread crashing on its own would); only process-level kinds make sense there (no engine code is running).
FaultPhase = Literal["load", "warmup", "generate", "idle"]


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One fault to inject. ``after_tokens`` only matters in the generate phase."""

    kind: FaultKind
    phase: FaultPhase = "generate"
    after_tokens: int = 0
    code: int = 1  # exit code for "exit"
    seconds: float = 0.05  # per-step delay for "slow"; delay after warmup for the "idle" phase
    lines: int = 10_000  # for "stderr_flood"
    size: int = 4096  # for "garbage": the frame length its prefix declares
    mimic: bool = False  # for "garbage": begin like a real message, so only its never-completing length betrays it
    rank: int | None = None  # the rank of a multi-rank instance it fires on; None: every rank


# --------------------------------------------------------------------------------------------------------------
# What a runner hosts
# --------------------------------------------------------------------------------------------------------------


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A runner's place in a multi-rank instance, handed out by tether: its rank, how many there are, and every
    rank's ``host:port`` in rank order (it listens on ``peers[rank]``). The ports belong to the instance's slot, so
    every life of the instance gets the same ones, as engines with fixed ports expect."""

    rank: int
    world_size: int
    peers: tuple[str, ...]
    shares: tuple[float, ...] = ()  # each rank's share of the work, where the engine divides it (layers): its node's
    # free memory when placed, else () for equal shares

    def address(self, rank: int | None = None) -> tuple[str, int]:
        """(host, port) of ``rank`` (default: this one)."""
        host, _, port = self.peers[self.rank if rank is None else rank].rpartition(":")
        return host, int(port)


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which engine a runner hosts and how to build it. ``options`` are engine-specific (n_ctx, n_threads, ...)."""

    engine: str = "llama.cpp"
    model: str | None = None  # a GGUF path for llama.cpp; None means the built-in default model
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    faults: tuple[Fault, ...] = ()  # load-time faults (debug engine)
    rank: RankInfo | None = None  # set by tether for each rank of a multi-rank instance (``ranks`` > 1)
    # set by the worker: a directory it owns (tmpfs) where the engine may keep what should outlive its runner, the
    # prompt cache's saved sequences for a resumed request (``tether.node.stores``); None: nothing outlives it
    store: str | None = None


class RunnerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a runner process needs at start, passed through its environment (not the channel)."""

    runner_id: str
    spec: EngineSpec
    worker_pid: int
    heartbeat_interval: float = 0.5  # seconds; 0 disables the heartbeat thread
    lifeline_fd: int | None = None  # read end of the worker's lifeline pipe (see ``lifeline``)
    orphan_layers: tuple[str, ...] = ("pdeathsig", "lifeline", "poll")
    orphan_poll_interval: float = 0.5  # seconds between parent-pid checks
    cgroup: str | None = None  # the memory cgroup the runner joins before it forks anything
    own_cgroup: bool = False  # that cgroup is the runner's alone: everything in it dies with the runner


RUNNER_MODULE = "tether.runner"


@dataclass(frozen=True)
class RunnerArgs:
    """A runner's command line: its pipe ends, plus its worker and id so ``ps`` and ``tether orphans`` see them."""

    tasks_fd: int
    events_fd: int
    worker_pid: int
    runner_id: str

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            RUNNER_MODULE,
            str(self.tasks_fd),
            str(self.events_fd),
            f"--worker={self.worker_pid}",
            f"--id={self.runner_id}",
        ]

    @classmethod
    def parse(cls, args: list[str]) -> RunnerArgs:
        """Parse the arguments after ``-m tether.runner``; raise ``ValueError`` when they are not a runner's."""
        if len(args) != 4 or not args[2].startswith("--worker=") or not args[3].startswith("--id="):
            raise ValueError(f"not a tether runner's arguments: {args!r}")
        return cls(int(args[0]), int(args[1]), int(args[2].partition("=")[2]), args[3].partition("=")[2])

    @classmethod
    def from_cmdline(cls, cmdline: list[str]) -> RunnerArgs | None:
        """The runner arguments of a process's full command line, or None when it is not a tether runner."""
        for i in range(len(cmdline) - 1):
            if cmdline[i] == "-m" and cmdline[i + 1] == RUNNER_MODULE:
                try:
                    return cls.parse(cmdline[i + 2 :])
                except ValueError:
                    return None
        return None


class MessageCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool call an earlier assistant turn made, for a chat template that writes calls itself (a model's native
    tool-call format): its id, function name and arguments (JSON text, as OpenAI carries them)."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn of a chat. ``tool_calls`` (an assistant's), ``tool_call_id`` and ``name`` (a "tool" turn's: the call
    it answers) are set only for a model whose template renders tools natively; otherwise the serving side has
    already written them into ``content`` in the generic format. ``reasoning``: an assistant turn's thinking as the
    client sent it back, which the template reads as ``reasoning_content`` (one that keeps a turn's thinking shows
    it; one that drops it drops it)."""

    role: str
    content: str
    tool_calls: tuple[MessageCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


def call_lead(open_: str, before: str) -> str:
    """What an answer of tool calls starts with, so a text answer may not: the first call's opening without trailing
    whitespace, or the "{" of its JSON object when calls are written bare. The runner's grammar and the serving
    side's parser both ask this one function, so they cannot disagree."""
    return (open_ + before).rstrip() or "{"


class ToolSyntax(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tools in a model's own format: the engine gives ``tools`` to the chat template (which describes them as the
    model was trained to read them) and constrains the answer to text, or to calls written as
    ``open (before call after) (separator before call after)* close`` where each call matches ``call_schema``.

    ``max_calls`` bounds the calls (0: the answer must be text); ``text``: a text answer is allowed (it may not start
    as a call does). The serving side decides all of it from the model's template (``serve/dialects/tools``)."""

    tools: str  # JSON text: a list of OpenAI-shaped tools ({"type": "function", "function": {...}})
    call_schema: str  # JSON text: the JSON Schema one call's object matches
    open: str = ""
    before: str = ""
    after: str = ""
    separator: str = ""
    close: str = ""
    max_calls: int = 1
    text: bool = True

    @property
    def lead(self) -> str:
        """What every answer of calls starts with, and a text answer must not: the first call's opening (without
        trailing whitespace), or the "{" of its JSON object when the format writes calls bare."""
        return call_lead(self.open, self.before)


class Resume(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a generation stood when its runner died, as the worker recorded it from the chunks it received: the
    token ids it produced, in order (every one a client was sent), and how many values its seeded draw had drawn.
    A runner given it continues the generation from the next token: it restores the prompt and these ids in its
    cells, replays them through what they changed (penalties, grammar, stop strings, thinking, the draw's state),
    and sends only what follows. Set by the worker alone, never by a client."""

    ids: tuple[int, ...]
    draws: int = 0
    seed: int | None = None  # the seed the first runner drew for an unseeded request (``Chunk.seed``)


MAX_TOKENS_LIMIT = (1 << 31) - 1  # a token count every engine (and the msgpack wire) can carry
TEMPERATURE_RANGE = (0.0, 2.0)  # OpenAI's
SEED_RANGE = (-(1 << 63), 1 << 64)  # [low, high): a 64-bit integer, signed or not (msgpack carries either)
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_TOP_LOGPROBS = 20  # OpenAI's
MAX_LOGIT_BIAS = 1024  # entries (OpenAI documents no limit; a bound keeps a request bounded)


def exactly_one(**given: object) -> InvalidField | None:
    """The refusal of an input given in none or several of its shapes (``given``: each shape's value, None unset)."""
    got = sum(value is not None for value in given.values())
    if got == 1:
        return None
    names = [f"'{name}'" for name in given]
    return InvalidField(None, f"set exactly one of {', '.join(names[:-1])} or {names[-1]} (got {got})")


class GenerateParams(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    """One generation. Exactly one of ``prompt`` (raw completion), ``prompt_ids`` (the same, as token ids) or
    ``messages`` (chat) is set.

    Sampling follows OpenAI's definitions where OpenAI has the parameter (``presence_penalty`` and
    ``frequency_penalty`` over the tokens generated so far, ``logit_bias`` added to the logits of token ids) and
    llama.cpp's for its extensions (``top_k``, ``min_p``, ``repeat_penalty``; None means the engine's default).
    ``logprobs``: None for none, else how many alternatives to report beside each chosen token (0 to 20).
    ``json_schema``: the JSON text of a JSON Schema the output must match (``{}`` for any JSON object is
    ``{"type": "object"}``), enforced by the engine's grammar-constrained sampling.
    ``prompt_ids``: a raw prompt as token ids, used as they are (no BOS added). ``echo``: the answer starts with
    the prompt (its text, and with ``logprobs`` each prompt token's entry, the first one's logprob NaN: nothing
    precedes it; an end-of-generation token then gets an entry too, as vLLM gives it); ``max_tokens`` may then be 0
    (the prompt's logprobs alone, as lm-eval's loglikelihood asks).
    ``prediction``: text the answer is expected to largely repeat (OpenAI's Predicted Outputs, ``prediction.content``):
    the engine tokenizes it and drafts tokens from it for the model to verify, so a good guess is generated in fewer
    steps (the model verifies every drafted token: a greedy answer is the one it gives without a prediction); the
    final chunk says how many drafted tokens were kept (``prediction_accepted``) and thrown away.
    """

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None
    json_schema: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # a raw prompt given as token ids (OpenAI's legacy completions shape)
    echo: bool = False  # the prompt's own tokens (with their logprobs when asked) lead the answer (completions)
    fit_context: bool = False  # a chat longer than the context keeps its system messages and latest turns (Ollama)
    context: int | None = None  # tokens prompt and answer may take together (Ollama's num_ctx); at most the n_ctx
    tool_syntax: ToolSyntax | None = None  # tools in the model's native format (a chat): see ``ToolSyntax``
    thinking: bool | None = None  # a reasoning model's template asked to think or not (enable_thinking); None: its own
    template_kwargs: str | None = None  # JSON text of an object: more variables for the chat template (a chat's)
    prediction: str | None = None  # the predicted text of the answer, to draft from (Predicted Outputs; see above)
    faults: tuple[Fault, ...] = ()  # per-request faults (debug engine)
    resume: Resume | None = None  # the worker's: continue a generation whose runner died (``Resume``)

    def check(self) -> InvalidField | None:
        """What is wrong with these parameters (naming the field), or None: the input's shape, then the sampling."""
        return self._input_problem() or self._sampling_problem()

    def _input_problem(self) -> InvalidField | None:
        """The prompt in one shape, the fields that need a given shape, and the token counts."""
        problem = exactly_one(prompt=self.prompt, messages=self.messages, prompt_ids=self.prompt_ids)
        if problem is not None:
            return problem
        if self.tool_syntax is not None and (self.messages is None or self.json_schema is not None):
            return InvalidField("tools", "tools need a chat (messages) and cannot be combined with a json_schema")
        if self.tool_syntax is not None and not 0 <= self.tool_syntax.max_calls <= 64:
            return InvalidField("tools", f"a turn makes 0 to 64 tool calls, got {self.tool_syntax.max_calls}")
        if self.prompt_ids is not None:
            if not self.prompt_ids:
                return InvalidField("prompt", "a token-id prompt needs at least one token")
            for i, token in enumerate(self.prompt_ids):
                if not 0 <= token <= MAX_TOKENS_LIMIT:
                    return InvalidField("prompt", f"token ids must be integers >= 0, got {token} at index {i}")
        if self.template_kwargs is not None and self.messages is None:
            return InvalidField("chat_template_kwargs", "chat_template_kwargs are a chat template's: send messages")
        if self.echo and self.messages is not None:
            return InvalidField("echo", "echo repeats a raw prompt (completions); a chat has none to repeat")
        fewest = 0 if self.echo else 1
        if not fewest <= self.max_tokens <= MAX_TOKENS_LIMIT:
            hint = " (0 only with echo: the prompt's logprobs alone)" if self.max_tokens == 0 else ""
            return InvalidField(
                "max_tokens", f"max_tokens must be in [{fewest}, {MAX_TOKENS_LIMIT}]{hint}, got {self.max_tokens}"
            )
        if self.context is not None and not 1 <= self.context <= MAX_TOKENS_LIMIT:
            return InvalidField("context", f"the context must be in [1, {MAX_TOKENS_LIMIT}] tokens, got {self.context}")
        return None

    def _sampling_problem(self) -> InvalidField | None:
        """Each sampling parameter within its range (OpenAI's where OpenAI has one)."""
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            return InvalidField("seed", f"seed must be a 64-bit integer (in [-2**63, 2**64)), got {self.seed}")
        low, high = TEMPERATURE_RANGE
        if not low <= self.temperature <= high:
            return InvalidField("temperature", f"temperature must be in [{low:g}, {high:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            return InvalidField("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:
                return InvalidField(name, f"{name} must be in [{low:g}, {high:g}] (0 is neutral), got {value}")
        if self.repeat_penalty is not None and not 0.0 < self.repeat_penalty <= 10.0:
            return InvalidField(
                "repeat_penalty", f"repeat_penalty must be in (0, 10] (1 is neutral), got {self.repeat_penalty}"
            )
        if self.top_k is not None and not 0 <= self.top_k <= MAX_TOKENS_LIMIT:
            return InvalidField("top_k", f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            return InvalidField("min_p", f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return InvalidField(
                "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            if not 0 <= token <= MAX_TOKENS_LIMIT:
                return InvalidField("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token}")
            if not low <= bias <= high:
                return InvalidField(
                    "logit_bias", f"logit_bias values must be in [{low:g}, {high:g}], got {bias} for token {token}"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            return InvalidField("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        return None


class EmbedParams(msgspec.Struct, tag="embed", frozen=True, forbid_unknown_fields=True):
    """One embedding: the vector of ``prompt`` or of the rendered ``messages`` (exactly one is set), on the final
    chunk's ``embedding``. ``fit_context``: an input longer than the context keeps its first ``n_ctx`` tokens
    (Ollama's ``truncate``) instead of being refused."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    fit_context: bool = False
    faults: tuple[Fault, ...] = ()  # per-request faults (debug engine)

    def check(self) -> InvalidField | None:
        """What is wrong with these parameters (naming the field), or None."""
        return exactly_one(prompt=self.prompt, messages=self.messages)


class TokenizeParams(msgspec.Struct, tag="tokenize", frozen=True, forbid_unknown_fields=True):
    """A question to the model's tokenizer, not a generation: the token ids of ``prompt`` or of the rendered
    ``messages`` (exactly one is set), answered on the final chunk's ``tokenized`` (``TokenizerAnswer``)."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special: bool = True  # add the BOS token the model's vocabulary asks for (as a prompt's tokens start)

    def check(self) -> InvalidField | None:
        """What is wrong with these parameters (naming the field), or None."""
        return exactly_one(prompt=self.prompt, messages=self.messages)


class DetokenizeParams(msgspec.Struct, tag="detokenize", frozen=True, forbid_unknown_fields=True):
    """A question to the model's tokenizer: the text of token ``ids`` (special tokens written out), as the final
    chunk's text, with the tokenizer's facts on its ``tokenized``."""

    ids: tuple[int, ...] = ()

    def check(self) -> InvalidField | None:
        """What is wrong with these parameters (naming the field), or None."""
        for i, token in enumerate(self.ids):
            if not 0 <= token <= MAX_TOKENS_LIMIT:
                return InvalidField("tokens", f"token ids must be integers >= 0, got {token} at index {i}")
        return None


Work = GenerateParams | EmbedParams | TokenizeParams | DetokenizeParams
"""What one request asks a runner for, told apart by its type (and on the wire by its tag); each kind checks only
its own rules, and an engine declines a kind it does not serve with a ``RequestError`` that says where to go."""

TokenizerWork = TokenizeParams | DetokenizeParams  # answered by the tokenizer at once, with no model step


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One candidate token: its text, its log-probability under the model, its bytes (``piece``: a token can be
    part of a character, so its text alone can lose information)."""

    token: str
    logprob: float
    piece: bytes


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A chosen token with its log-probability and the ``top`` most likely tokens at that position."""

    token: str
    logprob: float
    piece: bytes
    top: tuple[TopLogprob, ...] = ()


class TokenizerAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a tokenizer request (``TokenizerWork``) learns from the runner, which alone holds the model: the token
    ids of a ``TokenizeParams`` and each one's bytes, and the facts a client's remote tokenizer needs."""

    ids: tuple[int, ...] = ()  # "encode": the token ids
    pieces: tuple[bytes, ...] = ()  # "encode": each token's bytes (special tokens written out: ``<|im_end|>``)
    n_ctx: int = 0  # tokens one sequence's context holds: the longest prompt plus answer served
    n_vocab: int = 0
    bos_token: str | None = None  # the special tokens' texts and ids (None: the model has none)
    bos_id: int | None = None
    eos_token: str | None = None
    eos_id: int | None = None
    add_bos: bool = False  # whether a prompt's tokenization starts with BOS
    chat_template: str | None = None  # the model's own (Jinja), if it has one
    kind: str = ""  # the tokenizer's family, as the engine names it (llama.cpp: "gpt2", "llama", ...)


# --------------------------------------------------------------------------------------------------------------
# Tasks: supervisor -> runner
# --------------------------------------------------------------------------------------------------------------


class LoadTask(msgspec.Struct, tag="load", frozen=True):
    task_id: str


class WarmupTask(msgspec.Struct, tag="warmup", frozen=True):
    task_id: str


class GenerateTask(msgspec.Struct, tag="generate", frozen=True):
    """A request for the step loop: a generation, an embedding or a tokenizer question (``Work``, by its type)."""

    task_id: str
    params: Work


class ShutdownTask(msgspec.Struct, tag="shutdown", frozen=True):
    task_id: str


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """Not a task: a control message. The runner's reader thread acts on it at once, never behind generation."""

    task_id: str


Task = LoadTask | WarmupTask | GenerateTask | ShutdownTask
ToRunner = LoadTask | WarmupTask | GenerateTask | ShutdownTask | Cancel


# --------------------------------------------------------------------------------------------------------------
# Statuses
# --------------------------------------------------------------------------------------------------------------


class CauseKind(enum.StrEnum):
    EXIT_CODE = "exit_code"  # exited with a non-zero code
    UNEXPECTED_EXIT = "unexpected_exit"  # exited with code 0 without being asked to stop
    SIGNAL = "signal"  # killed by a signal
    EXCEPTION = "exception"  # a Python exception escaped the engine
    LOAD_ERROR = "load_error"  # the engine refused the model or its options (the user's to fix, not a crash)
    NATIVE_CRASH = "native_crash"  # a fatal signal with a faulthandler stack
    OUT_OF_MEMORY = "out_of_memory"
    HANG = "hang"
    ENGINE_ERROR = "engine_error"  # known fatal engine diagnostics on stderr
    PROTOCOL_ERROR = "protocol_error"  # the channel carried something that is not a valid frame
    SPAWN_ERROR = "spawn_error"  # the runner process could not be started
    STOP_ESCALATED = "stop_escalated"  # asked to stop, had to be terminated or killed
    DOES_NOT_FIT = "does_not_fit"  # refused before load: the model's estimate exceeds the memory available
    NODE_LOST = "node_lost"  # the runner's node agent died, its node was removed, went silent, or fenced itself
    PEER_LOST = "peer_lost"  # a rank's collective broke because another rank of its instance failed: a consequence


class Cause(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Why a runner is gone: one human line plus evidence (traceback lines, stderr tail, numbers)."""

    kind: CauseKind
    summary: str
    evidence: tuple[str, ...] = ()
    exit_code: int | None = None
    signal: str | None = None
    phase: str | None = None
    rank: int | None = None  # the rank that failed, in a multi-rank instance

    def render(self) -> str:
        if not self.evidence:
            return self.summary
        return self.summary + "\n" + "\n".join("  " + line for line in self.evidence)


class Idle(msgspec.Struct, tag="idle", frozen=True):
    pass


class Loading(msgspec.Struct, tag="loading", frozen=True):
    progress: float = 0.0  # 0..1
    detail: str = ""


class Loaded(msgspec.Struct, tag="loaded", frozen=True):
    pass


class WarmingUp(msgspec.Struct, tag="warming_up", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    pass


class Running(msgspec.Struct, tag="running", frozen=True):
    """Generating: ``running`` sequences in the engine's batch, ``waiting`` more accepted and queued for a slot."""

    running: int = 1
    waiting: int = 0


class ShuttingDown(msgspec.Struct, tag="shutting_down", frozen=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """The runner has shut down cleanly."""


class Failed(msgspec.Struct, tag="failed", frozen=True):
    cause: Cause


RunnerStatus = Idle | Loading | Loaded | WarmingUp | Ready | Running | ShuttingDown | Shutdown | Failed

_PHASES: dict[type, str] = {
    Idle: "idle",
    Loading: "loading",
    Loaded: "idle after loading",
    WarmingUp: "warming up",
    Ready: "idle",
    Running: "generating",
    ShuttingDown: "shutting down",
}


def phase_of(status: RunnerStatus) -> str | None:
    """What a runner in this status is doing, as words for a cause ("... while generating")."""
    return _PHASES.get(type(status))


# --------------------------------------------------------------------------------------------------------------
# Events: runner -> supervisor
# --------------------------------------------------------------------------------------------------------------


class TaskState(enum.StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self is not TaskState.RUNNING


class StatusUpdate(msgspec.Struct, tag="status", frozen=True):
    status: RunnerStatus


class TaskAcknowledged(msgspec.Struct, tag="ack", frozen=True):
    """Sent by the runner's reader thread the moment a task arrives (not when it starts): an unacknowledged task
    means a runner that stopped reading, which the supervisor treats as hung."""

    task_id: str


class CancelAcknowledged(msgspec.Struct, tag="cancel_ack", frozen=True):
    """The reader thread has set the task's cancel flag; the engine sees it before its next token."""

    task_id: str


class TaskStatus(msgspec.Struct, tag="task_status", frozen=True):
    """A task's state. COMPLETE / CANCELLED / FAILED are terminal: exactly one ends every task."""

    task_id: str
    state: TaskState
    error: str | None = None
    cause: Cause | None = None  # set when the task failed because its runner failed
    tokens: int = 0  # tokens generated so far (for Generate tasks)


FinishReason = Literal["stop", "length", "cancelled"]


class Chunk(msgspec.Struct, tag="chunk", frozen=True):
    """A text delta covering ``tokens`` tokens; the last one of a generation carries the finish reason."""

    task_id: str
    text: str
    tokens: int = 1  # tokens this delta covers
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # set on the final chunk
    completion_tokens: int = 0  # set on the final chunk
    sent_ns: int = 0  # CLOCK_MONOTONIC at send time (latency measurement; 0 = unset)
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this delta covers, when the request asked for logprobs
    embedding: tuple[float, ...] | None = None  # an embedding request's vector (on its final chunk)
    cached_tokens: int = 0  # of prompt_tokens, those the prompt cache supplied (on the final chunk)
    dropped_messages: int = 0  # ``fit_context``: the chat's oldest turns left out to fit the context (final chunk)
    prefilled: int = 0  # a progress report (no text, no tokens): prompt tokens prefilled so far (``is_progress``)
    reasoning: str = ""  # a reasoning model's thinking these tokens wrote (``text`` is then the answer's part only)
    draft_tokens: int = 0  # drafted tokens the model verified for this request (speculation; on the final chunk)
    draft_accepted: int = 0  # of those, the ones it kept
    prediction_accepted: int = 0  # of draft_accepted, those drawn from the request's ``prediction``
    prediction_rejected: int = 0  # tokens drafted from ``prediction`` and not kept
    decode_steps: int = 0  # engine steps that produced this request's completion tokens
    ids: tuple[int, ...] = ()  # the token ids this delta covers, from an engine that can resume (``Resume``)
    draws: int = 0  # values the request's seeded draw has drawn so far (with ``ids``: what a resume restores)
    seed: int | None = None  # the seed its draw uses (one the engine drew, for an unseeded request), with ``ids``
    resumed: int = 0  # times the worker resumed this generation on a new runner (set by the worker, final chunk)

    @property
    def is_progress(self) -> bool:
        """Only a report that a long prompt's prefill advanced: it restarts the first-token clock and no client
        sees it."""
        return self.prefilled > 0 and self.tokens == 0 and not self.text and self.finish_reason is None

    tokenized: TokenizerAnswer | None = None  # a tokenizer request's answer (``TokenizerWork``; final)


class ErrorChunk(msgspec.Struct, tag="error", frozen=True):
    """A generation that failed: what went wrong, in words, followed by a FAILED TaskStatus."""

    task_id: str
    message: str
    cause: Cause | None = None


class RunnerException(msgspec.Struct, tag="exception", frozen=True):
    """A Python exception that is about to end the runner, sent before it exits so it is never lost."""

    exc_type: str
    message: str
    traceback: str
    phase: str
    memory_error: bool = False
    load_error: bool = False  # an EngineLoadError: its message is the whole story, the traceback is noise


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Proof of life, with the runner's memory then (from /proc/self/statm: cheap enough for every beat), so a
    runner that dies of memory is reported with its last known footprint."""

    seq: int
    sent_ns: int
    rss: int = 0  # bytes
    anon: int = 0  # bytes: resident minus file-backed/shared pages


class RunnerHello(msgspec.Struct, tag="hello", frozen=True):
    """First message of every runner: who it is, so the supervisor can match the process it spawned."""

    pid: int
    pgid: int
    engine: str
    model: str | None


Event = (
    StatusUpdate
    | TaskAcknowledged
    | CancelAcknowledged
    | TaskStatus
    | Chunk
    | ErrorChunk
    | RunnerException
    | Heartbeat
    | RunnerHello
)

TERMINAL_STATES = frozenset({TaskState.COMPLETE, TaskState.CANCELLED, TaskState.FAILED})


def tag_of(message: msgspec.Struct) -> str:
    """The tag a tagged struct travels under: a status's name ("loading"), a task's kind ("generate")."""
    return str(type(message).__struct_config__.tag)


def task_kind(task: Task) -> str:
    return tag_of(task)
