"""Stops at any moment: Ctrl-C, SIGTERM and SIGHUP during start-up, model loading, generation or the wait for the
generation slot, and a worker dying under `run`, end with the conventional exit code, no traceback, and the answer
so far kept."""

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REAL_MODELS
from helpers import Worker, start_long

pytestmark = pytest.mark.usefixtures("isolated_config")


# ------------------------------------------------------------------ start-up and model loading
START = ("import runpy, sys; sys.stderr.write('started\\n'); sys.stderr.flush(); "
         "runpy.run_module('localspec', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("delay", [0.01, 0.03, 0.06, 0.1, 0.15, 0.25])
def test_ctrl_c_during_start_up_is_exit_130_without_traceback(long_model, delay):
    """A SIGINT in the first ~150 ms (Python importing the CLI) is exit 130 without a KeyboardInterrupt traceback.
    (The interpreter's own start-up, before any localspec code, is not ours: the signal goes after it.)"""
    p = subprocess.Popen([sys.executable, "-c", START, "run", "-m", str(long_model), "-c", "8192", "-n", "8000",
                          "--method", "lookup", "--raw", "the cat"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stderr.readline() == b"started\n"
    time.sleep(delay)
    os.kill(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err.decode())
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


def test_a_stop_while_the_cli_imports_its_parts_is_exit_130(monkeypatch):
    """A stop that lands while main() imports its parts (the download progress bars), before _main's own
    KeyboardInterrupt handler, is exit 130 too, not death by the signal with a traceback."""
    from localspec.cli import app as cli_app
    from localspec.cli import progress

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(progress, "install", stopped)
    with pytest.raises((SystemExit, KeyboardInterrupt)) as exc:
        cli_app.main(["run", "--help"])
    assert exc.type is SystemExit and exc.value.code == 130


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="watches /proc/PID/maps for the model mapping")
def test_ctrl_c_while_loading_exits_130(smollm_or_tiny):
    model = os.path.realpath(smollm_or_tiny)
    p = subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", model, "-n", "100000", "--raw", "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # llama.cpp maps the file once the header is read: it is loading now
        with open(f"/proc/{p.pid}/maps") as fh:
            if model in fh.read():
                break
        time.sleep(0.001)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 130, err.decode()[-500:]
    assert b"Exception ignored" not in err and b"Traceback" not in err
    assert out == b""  # it stopped before generating


@pytest.fixture
def smollm_or_tiny(target_path):
    p = REAL_MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else target_path


def test_interrupt_inside_load_aborts_and_raises(target_path):
    """In-process: a SIGINT during llama_model_load_from_file makes the progress callback stop the load, and
    KeyboardInterrupt comes out of Model() (the C no-op log callback runs no Python that could drop it)."""
    from localspec.llama import lib
    from localspec.llama import model
    calls = []

    def progress(self, fraction, user_data):
        if not calls:
            signal.raise_signal(signal.SIGINT)  # runs our deferring handler: only a flag is set
        calls.append(fraction)
        return self.received is None

    before = signal.getsignal(signal.SIGINT)
    orig = lib.DeferSignals.progress
    lib.DeferSignals.progress = progress
    try:
        with pytest.raises(KeyboardInterrupt):
            model.Model(target_path, n_ctx=64)
    finally:
        lib.DeferSignals.progress = orig
    assert calls and calls[-1] < 1.0  # aborted before the end
    assert signal.getsignal(signal.SIGINT) is before
    model.Model(target_path, n_ctx=64).close()  # and the next load works




# ------------------------------------------------------------------ a stop while generating
def test_sigint_keeps_partial_output_and_exits_130(long_model):
    p = subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", str(long_model), "-c", "60000",
                          "-n", "59000", "--method", "lookup", "--raw", "the cat"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(20)  # generation has started
    assert first
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err
    assert len(first + rest) > 20



def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_tokens(p, timeout=180.0):
    """--json/--no-stream print nothing until the end: wait until the run holds the machine-wide generation slot
    (taken right before generating), then a little longer."""
    from filelock import FileLock, Timeout

    from localspec.store.cachefile import cache_dir

    lock = FileLock(str(cache_dir() / "locks" / "generation-slot-0.lock"))
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        assert p.poll() is None, p.communicate()
        try:
            lock.acquire(timeout=0)
            lock.release()
        except Timeout:
            # past the one-time exactness probe and into the answer: 6 s of the process's own CPU time, however
            # loaded the machine is
            start = cpu_s(p.pid)
            while cpu_s(p.pid) - start < 6.0 and time.monotonic() - t < timeout:
                time.sleep(0.2)
            return
        time.sleep(0.1)
    raise AssertionError("generation did not start")


@pytest.mark.parametrize("mode", ["--json", "--no-stream"])
def test_interrupt_keeps_the_partial_answer(long_model, mode):
    """Ctrl-C with --json prints the text generated so far beside its token count; with --no-stream, that text."""
    p = start_long(long_model, mode)
    wait_for_tokens(p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    if mode == "--json":
        d = json.loads(out)
        assert d["finish_reason"] == "interrupted" and d["completion_tokens"] > 0
        assert len(d["text"]) > 0
    else:
        assert len(out.strip()) > 0
    assert b"Traceback" not in err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_behave_like_ctrl_c(long_model, sig, code):
    p = start_long(long_model, "--json")
    wait_for_tokens(p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    d = json.loads(out)
    assert d["finish_reason"] == "interrupted" and d["text"]
    assert b"tokens" in err  # the summary


def test_interrupt_message_mentions_downloads_only_when_one_happened(long_model):
    """The interrupt message speaks of a kept partial download only when a download happened."""
    p = start_long(long_model)
    assert p.stdout.read(20)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"download" not in err


@pytest.mark.parametrize("gap", [0.02, 0.1])
def test_two_quick_ctrl_c_keep_the_answer_and_exit_130(long_model, gap):
    """Two SIGINTs 20 ms or 100 ms apart (no crash, no death by the signal): each time exit 130, the partial answer
    on stdout, no traceback."""
    for _ in range(3):
        p = start_long(long_model)
        first = p.stdout.read(40)  # the answer is streaming
        assert first
        os.kill(p.pid, signal.SIGINT)
        time.sleep(gap)
        try:
            os.kill(p.pid, signal.SIGINT)
        except ProcessLookupError:  # already gone: the first one was enough
            pass
        out, err = p.communicate(timeout=120)
        assert p.returncode == 130, (p.returncode, err.decode())
        assert b"Traceback" not in err, err.decode()
        assert (first + out).strip()


class Terminal:
    """A terminal for a run's stderr, read on a thread: --json and --no-stream print nothing on stdout until the
    end, but on a terminal the run shows its live status line, with the tokens generated so far. A test waits on
    those (what the run has done), never on a clock."""

    TOKENS = re.compile(r"(\d+) tok(?![/\w])")

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self.raw = ""
        self.tokens = 0  # the most the live status line has shown
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "localspec", *args], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=self.slave)
        os.close(self.slave)  # the child's copy is the only one left: the read ends when the child does
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return p

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            with self._lock:
                self.raw += data.decode("utf-8", "replace")
                seen = [int(n) for n in self.TOKENS.findall(self.raw[-8192:])]
                self.tokens = max([self.tokens, *seen])
        os.close(self.master)

    def wait(self, p: subprocess.Popen, what: str, done, timeout: float = 300.0) -> None:
        """Until done() holds; the run must still be going (a run that ended first fails the test, with its
        output)."""
        end = time.monotonic() + timeout
        while not done():
            assert p.poll() is None, (f"the run ended before {what}", p.returncode, self.lines())
            assert time.monotonic() < end, (f"no {what}", self.lines())
            time.sleep(0.05)

    def wait_for_tokens(self, p: subprocess.Popen, n: int = 1) -> int:
        self.wait(p, f"{n} generated tokens", lambda: self.tokens >= n)
        return self.tokens

    def lines(self) -> list[str]:
        """What the run wrote on stderr, one line per line and per status refresh, escape sequences removed."""
        if self._reader is not None:
            self._reader.join(30)
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|\x1b\][^\x07]*\x07", "", self.raw)
        return [l for l in re.split(r"[\r\n]+", text) if l.strip()]


# more tokens than any machine generates between the first status line that shows some and the stop the test then
# sends: the stop always lands in the middle of the answer
LONG_N = "16000"


@pytest.mark.parametrize("mode", ["--json", "--no-stream"])
def test_worker_death_under_json_or_no_stream_prints_the_answer_so_far(long_model, mode):
    """When the worker dies, the error says "the answer so far is kept" and --json and --no-stream print it. The worker
    is killed once the run shows generated tokens (with --rpc the compute runs in the worker, so the client's own
    CPU time says nothing about how far the answer is)."""
    w = Worker("--threads", "1")
    term = Terminal()
    try:
        p = term.start("run", "-m", str(long_model), "--rpc", w.endpoint, "-c", "16384", "-n", LONG_N,
                       "--method", "none", "--raw", mode, "the cat")
        seen = term.wait_for_tokens(p)
        w.kill()
        out, _ = p.communicate(timeout=60)
    finally:
        w.kill()
    err = term.lines()
    assert p.returncode == 1, (p.returncode, err[-20:])
    assert err[-1].startswith("error: ") and "the answer so far is kept" in err[-1], err[-3:]  # on a line of its own
    assert not any("Traceback" in l for l in err), err[-20:]
    if mode == "--json":
        d = json.loads(out)
        assert d["finish_reason"] == "error" and d["text"]
        assert seen <= d["completion_tokens"] < int(LONG_N)  # every token it had shown is in the answer kept
        assert d["rpc_workers"] == [w.endpoint]
    else:
        assert out.strip() and b"ggml" not in out


def _hold_the_generation_slot():
    """The machine-wide generation slot (session.generation_slot), taken as another localspec generation would."""
    from filelock import FileLock

    from localspec.store.cachefile import cache_dir

    (cache_dir() / "locks").mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir() / "locks" / "generation-slot-0.lock"))
    lock.acquire(timeout=0)
    return lock


WAITING = "waiting for another localspec generation to finish"


@pytest.mark.parametrize("mode", ["--json", "--no-stream"])
def test_ctrl_c_while_waiting_for_the_generation_slot_says_what_it_stopped(long_model, mode):
    """A stop while the run waits for another process's generation says what it interrupted, and prints nothing on
    stdout (no answer was begun)."""
    lock = _hold_the_generation_slot()
    term = Terminal()
    try:
        p = term.start("run", "-m", str(long_model), "-c", "8192", "-n", "8000", "--method", "lookup", "--raw",
                       mode, "the cat")
        term.wait(p, "the waiting notice", lambda: WAITING in term.raw)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        lock.release()
    err = term.lines()
    assert p.returncode == 130, (p.returncode, err)
    assert out == b""
    assert err[-1] == "interrupted while waiting for another localspec generation to finish", err
    assert not any("Traceback" in l or "KeyboardInterrupt" in l for l in err), err


def test_ctrl_c_after_the_generation_slot_is_taken_prints_the_answer_so_far_as_json(long_model):
    """Once the other generation is done and this run generates, a stop prints the answer so far as JSON."""
    lock = _hold_the_generation_slot()
    term = Terminal()
    try:
        p = term.start("run", "-m", str(long_model), "-c", "16384", "-n", LONG_N, "--method", "lookup", "--raw",
                       "--json", "the cat")
        term.wait(p, "the waiting notice", lambda: WAITING in term.raw)
    finally:
        lock.release()
    seen = term.wait_for_tokens(p)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    err = term.lines()
    assert p.returncode == 130, (p.returncode, err[-20:])
    d = json.loads(out)
    assert d["finish_reason"] == "interrupted" and d["text"]
    assert seen <= d["completion_tokens"] < int(LONG_N)
    assert not any("Traceback" in l for l in err) and not any(l.startswith("interrupted while") for l in err)


def test_main_called_in_process_gives_ctrl_c_back_after_a_stop(monkeypatch):
    """After a stop, main() ignores SIGINT, SIGTERM and SIGHUP only for the process's own exit (main() with no argv:
    the console script, python -m localspec), so that the interpreter's teardown survives a second Ctrl-C. Called
    in-process (an embedder, this test suite) it gives the handlers back: otherwise children started later would
    inherit an ignored SIGINT."""
    from localspec.cli import app as cli_app

    def stopped(argv):
        cli_app._on_signal(signal.SIGINT, None)  # what a Ctrl-C does while a command runs

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli_app, "_main", stopped)
    with pytest.raises(SystemExit) as exc:
        cli_app.main(["run", "x"])
    assert exc.value.code == 130
    assert signal.getsignal(signal.SIGINT) is before
