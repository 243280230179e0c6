"""The llama.cpp engine (llama-cpp-python), serving the built-in SmolLM2 model or any GGUF file.

Three deliberate departures from the library's defaults, each for the supervisor's sake:

* The model is built with ``verbose=True``. With ``verbose=False`` llama-cpp-python ``dup2``s file
  descriptors 1 and 2 to /dev/null for the whole model load, process-wide: a crash during load would lose its
  native stack (faulthandler writes to fd 2) and every other thread's output would vanish. Instead,
  llama.cpp's log callback is replaced by one that forwards only warnings and errors (everything when the
  ``verbose`` option is set), and the library's own Python-level chatter during construction is filtered out
  for the loading thread only.
* Load progress is real: ``llama_model_params.progress_callback`` is wired through ctypes (the ``Llama``
  constructor has no hook, so ``llama_model_default_params`` is wrapped for the duration of the constructor).
* Chat prompts are rendered here with the GGUF's own chat template (what ``create_chat_completion`` does
  internally), so the prompt's exact token count is known before generating: a prompt that does not fit the
  context is a ``RequestError`` with numbers, and the final delta reports real ``prompt_tokens``.

Options (``spec.options``): n_ctx (2048), n_threads (usable CPUs, at most 8), n_batch (512), seed (0),
n_gpu_layers (0), repeat_penalty (1.0: neutral, unlike llama-cpp-python's 1.1), verbose (False).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TextIO

from tether.engines.base import Delta, EngineLoadError, ProgressCallback, RequestError
from tether.engines.gguf import GGUF_MAGIC, not_gguf
from tether.models import DEFAULT_MODEL_NAME, DefaultModelMissing, default_model_path, describe_model
from tether.protocol import EngineSpec, FinishReason, GenerateParams

if TYPE_CHECKING:
    from tether.engines.llamacpp_estimate import ModelEstimate

INSTALL_HINT = "run `make install` (or `pip install 'tether[llama]'`)"
OPTION_DEFAULTS: dict[str, Any] = {
    "n_ctx": 2048,
    "n_threads": None,  # computed: usable CPUs, at most 8
    "n_batch": 512,
    "seed": 0,
    "n_gpu_layers": 0,
    "repeat_penalty": 1.0,  # neutral, as in OpenAI's API; llama-cpp-python's 1.1 derails small models
    "verbose": False,
}
UINT32_MAX = (1 << 32) - 1  # llama.cpp's context and batch sizes are uint32
PROGRESS_STEP = 0.05  # report load progress in steps of at least 5% so the channel is not flooded
GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 3, 4, 5  # enum ggml_log_level (NONE 0, DEBUG 1, INFO 2)


def default_threads() -> int:
    """CPUs this process may run on (affinity and cpusets honoured), capped at 8: beyond that, token
    generation is memory-bound and extra threads only contend."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(usable, 8))


class LlamaCppEngine:
    """llama-cpp-python behind the tether engine protocol. Driven by one thread; see the module docstring."""

    name = "llama.cpp"
    options = MappingProxyType(OPTION_DEFAULTS)

    @staticmethod
    def estimate_memory(spec: EngineSpec) -> ModelEstimate:
        """Weights + KV cache + runtime + headroom at the options' n_ctx and n_batch, read from the GGUF's header."""
        from tether.engines.llamacpp_estimate import estimate_for_spec

        return estimate_for_spec(spec, {**OPTION_DEFAULTS, **spec.options})

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        unknown = sorted(set(spec.options) - set(OPTION_DEFAULTS))
        if unknown:
            raise EngineLoadError(
                f"unknown llama.cpp engine option(s) {', '.join(unknown)}: "
                f"valid options are {', '.join(OPTION_DEFAULTS)}"
            )
        options = {**OPTION_DEFAULTS, **spec.options}
        try:
            self.n_ctx = int(options["n_ctx"])
            self.n_threads = int(options["n_threads"]) if options["n_threads"] else default_threads()
            self.n_batch = int(options["n_batch"])
            self.seed = int(options["seed"])
            self.n_gpu_layers = int(options["n_gpu_layers"])
            self.repeat_penalty = float(options["repeat_penalty"])
            self.verbose = bool(options["verbose"])
        except (TypeError, ValueError, OverflowError) as exc:
            raise EngineLoadError(f"invalid llama.cpp engine option in {spec.options!r}: {exc}") from exc
        if not (16 <= self.n_ctx <= UINT32_MAX and 1 <= self.n_threads <= 4096 and 1 <= self.n_batch <= UINT32_MAX):
            raise EngineLoadError(
                f"n_ctx must be in [16, {UINT32_MAX}], n_threads in [1, 4096] and n_batch in [1, {UINT32_MAX}] (got "
                f"n_ctx={self.n_ctx}, n_threads={self.n_threads}, n_batch={self.n_batch})"
            )
        self.model_path: Path | None = None
        self._llm: Any = None
        self._chat_formatter: Any = None

    # -------------------------------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        """Open the GGUF and build the model, reporting llama.cpp's real tensor-loading progress."""
        path = self._resolve_model_path()
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as llama_lowlevel
        except ImportError as exc:
            raise EngineLoadError(f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}") from exc

        described = describe_model(path)
        progress(0.0, f"opening {described}")
        _install_log_filter(llama_lowlevel, self.verbose)
        reporter = _ProgressReporter(progress, described)
        started = time.monotonic()
        try:
            with _progress_hook(llama_lowlevel, reporter), _quiet_python_stderr(enabled=not self.verbose):
                llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=self.n_ctx,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    n_batch=min(self.n_batch, self.n_ctx),
                    n_gpu_layers=self.n_gpu_layers,
                    seed=self.seed,
                    verbose=True,  # see the module docstring: verbose=False would blind stderr during load
                )
        except ValueError as exc:  # llama-cpp-python reports load failures as ValueError
            raise EngineLoadError(
                f"llama.cpp could not load {described} from {path}: {exc}. Check that it is a complete GGUF "
                "file this llama.cpp version supports (the stderr tail has llama.cpp's reason)"
            ) from exc
        llm.verbose = self.verbose  # silence per-request timing prints unless asked for
        self._llm = llm
        self._chat_formatter = _chat_formatter(llama_cpp, llm)
        progress(1.0, f"loaded {described} in {time.monotonic() - started:.1f} s")

    def warmup(self) -> None:
        """Generate one token so weights are paged in and buffers allocated before the first request."""
        llm = self._require_llm()
        llm.create_completion(prompt="Hello", max_tokens=1, temperature=0.0)

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        """Check the request and its prompt length now (``RequestError``), then return the delta stream."""
        llm = self._require_llm()
        problem = params.check()
        if problem is not None:
            raise RequestError(str(problem))
        stop = list(params.stop)
        stopping_criteria = None
        if params.messages is not None:
            prompt_tokens, template_stop, stopping_criteria = self._render_chat(params)
            stop += template_stop
        else:
            prompt_tokens = llm.tokenize((params.prompt or "").encode("utf-8"), add_bos=True, special=True)
            if not prompt_tokens:  # an empty prompt on a model without BOS-adding: condition on BOS alone
                prompt_tokens = [llm.token_bos()]
        n_ctx = llm.n_ctx()
        if len(prompt_tokens) >= n_ctx:
            raise RequestError(
                f"prompt is {len(prompt_tokens)} tokens but n_ctx is {n_ctx}: shorten it or raise --n-ctx"
            )
        stream = llm.create_completion(
            prompt=prompt_tokens,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop=stop,
            seed=params.seed,
            repeat_penalty=self.repeat_penalty,
            stopping_criteria=stopping_criteria,
            stream=True,
        )
        return self._deltas(stream, len(prompt_tokens), cancelled)

    def close(self) -> None:
        """Free the model and context now rather than whenever the garbage collector runs."""
        llm, self._llm, self._chat_formatter = self._llm, None, None
        if llm is not None and hasattr(llm, "close"):
            llm.close()

    # -------------------------------------------------------------------------------------------------------

    def _resolve_model_path(self) -> Path:
        if self.spec.model is None:
            try:
                path = default_model_path()
            except DefaultModelMissing as exc:
                raise EngineLoadError(str(exc)) from exc
        else:
            path = Path(self.spec.model).expanduser()
        if not path.is_file():
            raise EngineLoadError(
                f"model file {path} does not exist: pass the path of a GGUF file, or omit the model to use "
                f"the built-in {DEFAULT_MODEL_NAME} ({INSTALL_HINT} if it is missing)"
            )
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise EngineLoadError(f"cannot read model file {path}: {exc}") from exc
        if magic != GGUF_MAGIC:
            raise EngineLoadError(str(not_gguf(path, magic)))
        self.model_path = path
        return path

    def _require_llm(self) -> Any:
        if self._llm is None:
            raise RuntimeError("llama.cpp engine used before load() (or after close())")
        return self._llm

    def _render_chat(self, params: GenerateParams) -> tuple[list[int], list[str], Any]:
        """Render the chat with the model's template and tokenize it, exactly as llama-cpp-python's chat
        handler does, so the token count is the real one."""
        llm = self._require_llm()
        messages = [{"role": m.role, "content": m.content} for m in params.messages or ()]
        if self._chat_formatter is None:
            raise RequestError(
                f"{describe_model(self.model_path or '?')} has no chat template: send a raw 'prompt' instead"
            )
        try:
            result = self._chat_formatter(messages=messages)
        except Exception as exc:  # template errors (e.g. unsupported roles) are the request's fault
            raise RequestError(f"the model's chat template rejected these messages: {exc}") from exc
        tokens = llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
        stop = result.stop
        template_stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        return tokens, template_stop, result.stopping_criteria

    def _deltas(self, stream: Iterator[Any], prompt_tokens: int, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        """One delta per streamed piece; cancellation is checked before each piece is produced."""
        completion_tokens = 0
        try:
            while True:
                if cancelled():
                    yield Delta("", 0, "cancelled", prompt_tokens, completion_tokens)
                    return
                chunk = next(stream, None)
                if chunk is None:  # ended without a finish reason: treat as the length limit
                    yield Delta("", 0, "length", prompt_tokens, completion_tokens)
                    return
                choice = chunk["choices"][0]
                text: str = choice.get("text") or ""
                finish = choice.get("finish_reason")
                tokens = 1 if text else 0
                completion_tokens += tokens
                if finish is not None:
                    reason: FinishReason = "stop" if finish == "stop" else "length"
                    yield Delta(text, tokens, reason, prompt_tokens, completion_tokens)
                    return
                if text:
                    yield Delta(text, tokens)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # stops llama's generation loop now, not when the generator is collected


# ----------------------------------------------------------------------------------------------------------
# Load-time plumbing
# ------------------------------------------------------------------------------------------------------------


class _ProgressReporter:
    """Turns llama.cpp's progress callback (called from C, on the loading thread) into throttled reports.

    Tensor loading maps to 0..0.95; the last 5% is context creation, reported as 1.0 by ``load`` itself. It
    never raises into C and always returns True: a ctypes callback that raises returns False, which would make
    llama.cpp abort the load.
    """

    def __init__(self, progress: ProgressCallback, described: str) -> None:
        self.progress = progress
        self.described = described
        self.last = 0.0
        self.error: BaseException | None = None

    def __call__(self, fraction: float, _user_data: Any) -> bool:
        try:
            value = 0.95 * min(max(float(fraction), 0.0), 1.0)
            if value - self.last >= PROGRESS_STEP * 0.95 or (fraction >= 1.0 and value > self.last):
                self.last = value
                self.progress(value, f"loading {self.described}: tensors {fraction:.0%}")
        except BaseException as exc:  # must not propagate into C
            self.error = exc
        return True


@contextlib.contextmanager
def _progress_hook(llama_lowlevel: Any, reporter: _ProgressReporter) -> Iterator[None]:
    """Make the ``Llama`` constructor's model params carry our progress callback.

    ``Llama.__init__`` builds its params with ``llama_model_default_params()`` and offers no hook, so that
    function is wrapped while the constructor runs (only this thread loads models). The ctypes callback object
    is kept alive here until the load is over. If the library changes shape, progress just stays coarse.
    """
    original = getattr(llama_lowlevel, "llama_model_default_params", None)
    prototype = getattr(llama_lowlevel, "llama_progress_callback", None)
    if original is None or prototype is None:
        yield
        return
    callback = prototype(reporter)

    def with_progress() -> Any:
        params = original()
        with contextlib.suppress(AttributeError, TypeError):
            params.progress_callback = callback
            params.progress_callback_user_data = None
        return params

    llama_lowlevel.llama_model_default_params = with_progress
    try:
        yield
    finally:
        llama_lowlevel.llama_model_default_params = original
        if reporter.error is not None:
            raise reporter.error


_log_callback: Any = None  # the installed ctypes log callback; must stay referenced while llama.cpp may log


def _install_log_filter(llama_lowlevel: Any, verbose: bool) -> None:
    """Route llama.cpp's log to fd 2 directly: warnings and errors always, everything when ``verbose``.

    Writing to the fd (not ``sys.stderr``) works from any native thread and cannot be swallowed by stream
    swapping; the supervisor captures fd 2 line by line and scans it for engine error patterns.
    """
    global _log_callback
    state = {"forward": False}

    def on_log(level: int, text: bytes | None, _user_data: Any) -> None:
        try:
            if level != GGML_LOG_CONT:
                state["forward"] = verbose or level in (GGML_LOG_WARN, GGML_LOG_ERROR)
            if state["forward"] and text:
                os.write(2, text)
        except BaseException:  # never raise into C
            pass

    _log_callback = llama_lowlevel.llama_log_callback(on_log)
    llama_lowlevel.llama_log_set(_log_callback, None)


class _ThreadFilteredStream:
    """A ``sys.stderr`` stand-in that drops writes from one thread and passes every other thread's through."""

    def __init__(self, target: TextIO, drop_thread: int) -> None:
        self._target = target
        self._drop_thread = drop_thread

    def write(self, text: str) -> int:
        if threading.get_ident() == self._drop_thread:
            return len(text)
        return self._target.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextlib.contextmanager
def _quiet_python_stderr(enabled: bool) -> Iterator[None]:
    """Hide llama-cpp-python's verbose Python prints (system info, the whole chat template) while this thread
    builds the model. Only ``sys.stderr`` is swapped, never fd 2, and other threads' writes pass through."""
    if not enabled:
        yield
        return
    original = sys.stderr
    sys.stderr = _ThreadFilteredStream(original, threading.get_ident())
    try:
        yield
    finally:
        sys.stderr = original


def _chat_formatter(llama_cpp: Any, llm: Any) -> Any:
    """The GGUF's own chat template as a formatter (None if the model has none), built as llama-cpp-python
    does for its default chat handler."""
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None

    def token_text(token_id: int) -> str:
        if token_id == -1:
            return ""
        piece: bytes = llm.detokenize([token_id], special=True)
        return piece.decode("utf-8", errors="replace")

    eos_id = llm.token_eos()
    return llama_cpp.llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=token_text(eos_id),
        bos_token=token_text(llm.token_bos()),
        stop_token_ids=[eos_id],
    )
