"""The target on llama.cpp RPC workers (`localspec worker`), the draft local; failures are one clear line."""

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from helpers import Worker, cli, free_port, one_error_line
from localspec import rpcwire as rpc
from localspec.errors import UsageError

pytestmark = pytest.mark.usefixtures("clean_config")

SECURITY = "the RPC protocol has no authentication and no encryption"


# ------------------------------------------------------------------ helpers
@pytest.fixture(scope="session")
def workers():
    ws = [Worker("--threads", "1"), Worker("--threads", "1")]
    yield ws
    for w in ws:
        if w.proc.poll() is None:
            assert w.interrupt() == 130, "".join(w.lines)
            assert "worker stopped" in "".join(w.lines)


class FakeServer:
    """Accepts connections on 127.0.0.1 and answers each with `reply` bytes, then closes."""

    def __init__(self, reply: bytes):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.reply = reply
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                c.settimeout(2)
                try:
                    c.recv(64)
                    if self.reply:
                        c.sendall(self.reply)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def local_plain(path, prompts, n):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(path, n_ctx=1024)
    try:
        return [e.complete(e.raw_prompt(p), GenConfig(method="none", max_tokens=n)).tokens for p in prompts]
    finally:
        e.close()


# ------------------------------------------------------------------ parsing
def test_parse_servers():
    assert rpc.parse_servers("127.0.0.1:50052, 10.0.0.2:1") == ["127.0.0.1:50052", "10.0.0.2:1"]
    assert rpc.parse_servers("") == [] and rpc.parse_servers(None) == []
    for bad in ("nohost", "h:", ":5", "h:x", "h:0", "h:70000", "::1:5", "a:1,a:1", "a:1,,b:2"):
        with pytest.raises(UsageError):
            rpc.parse_servers(bad)


def test_parse_tensor_split():
    assert rpc.parse_tensor_split("3,1") == [3.0, 1.0] and rpc.parse_tensor_split("1/2") == [1.0, 2.0]
    assert rpc.parse_tensor_split(None) is None
    for bad in ("x", "0,0", "-1,2", "nan", "inf,1"):
        with pytest.raises(UsageError):
            rpc.parse_tensor_split(bad)


def test_bad_rpc_flags_are_usage_errors(target_path):
    assert "bad worker address" in one_error_line(cli(["run", "-m", str(target_path), "--rpc", "nope", "hi"]), 2)
    one_error_line(cli(["run", "-m", str(target_path), "--rpc", "127.0.0.1:1", "--tensor-split", "x", "hi"]), 2)


# ------------------------------------------------------------------ the worker
def test_worker_answers_hello_with_this_builds_version(workers):
    for w in workers:
        assert rpc.hello(w.endpoint) == (rpc.RPC_PROTO_MAJOR, rpc.RPC_PROTO_MINOR, rpc.RPC_PROTO_PATCH)
        assert not w.out or not "".join(w.out).strip()  # llama.cpp's printf lines go to stderr, not stdout
        assert SECURITY not in "".join(w.lines)  # loopback: no warning


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the route towards a public address; nothing is sent)."""
    for probe in ("192.0.2.1", "10.255.255.255", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if addr and not addr.startswith("127.") and addr != "0.0.0.0":
            return addr
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not info[4][0].startswith("127."):
                return info[4][0]
    except OSError:
        pass
    return None


def test_worker_binds_loopback_by_default(workers):
    w = workers[0]
    socket.create_connection(("127.0.0.1", w.port), timeout=5).close()
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((addr, w.port), timeout=5).close()


def test_non_loopback_host_warns_and_ctrl_c_exits_130():
    w = Worker("--host", "0.0.0.0", "--threads", "1")
    try:
        log = "".join(w.lines)
        assert "worker listening on 0.0.0.0:" in log
        assert SECURITY in log and "trusted network" in log
    finally:
        rc = w.interrupt()
    assert rc == 130 and "worker stopped" in "".join(w.lines)
    assert "Traceback" not in "".join(w.lines)


def test_worker_port_in_use_is_one_error_line(workers):
    r = cli(["worker", "--port", str(workers[0].port)], timeout=60)
    assert "in use" in one_error_line(r, 1)


def test_worker_bad_host_is_usage_error():
    one_error_line(cli(["worker", "--host", "not-an-ip"], timeout=60), 2)


# ------------------------------------------------------------------ the target on the workers
PROMPTS = ["Hello world, the x = y + 1", "def f(x): return x"]


def test_split_target_same_tokens_as_local_plain(workers, target_path, draft_path):
    from localspec.core.engine import Engine, GenConfig

    n = 48
    want = local_plain(target_path, PROMPTS, n)
    eps = [w.endpoint for w in workers]
    e = Engine.load(target_path, draft_path, n_ctx=1024, rpc=",".join(eps))
    try:
        assert e.target.rpc_servers == eps and e.draft.rpc_servers == []  # the draft stays local
        for cfg in (GenConfig(method="none", max_tokens=n), GenConfig(method="draft", k=3, max_tokens=n, p_min=0.0),
                    GenConfig(method="lookup", k=3, max_tokens=n), GenConfig(method="auto", k=4, max_tokens=n)):
            drafted = 0
            for p, w in zip(PROMPTS, want):
                fin = e.complete(e.raw_prompt(p), cfg)
                assert fin.tokens == w, (cfg.method, p)
                assert fin.stats.rpc_workers == eps
                drafted += fin.stats.drafted
            assert drafted > 0 or cfg.method != "draft"  # it did speculate
    finally:
        e.close()


def test_cli_rpc_places_layers_on_both_workers_and_reports_them(workers, target_path):
    eps = [w.endpoint for w in workers]
    local = cli(["run", "-m", str(target_path), "--method", "none", "-n", "24", "--json", "--raw", "the cat"])
    assert local.returncode == 0, local.stderr
    r = cli(["run", "-m", str(target_path), "--rpc", ",".join(eps), "--tensor-split", "1,1", "-n", "24", "--json",
             "--raw", "the cat"], env={"LOCALSPEC_LLAMA_LOG": "1"})
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    d = json.loads(r.stdout)
    assert d["rpc_workers"] == eps and d["text"] == json.loads(local.stdout)["text"]
    assert json.loads(local.stdout)["rpc_workers"] == []
    log = r.stderr.decode()
    for ep in eps:  # llama.cpp's own account of where the weights went
        assert any(ep in line and "model buffer size" in line for line in log.splitlines()), (ep, log[-3000:])


def test_rpc_from_env_and_summary_line(workers, target_path):
    ep = workers[1].endpoint
    r = cli(["run", "-m", str(target_path), "-n", "8", "--raw", "the cat"], env={"LOCALSPEC_RPC": ep})
    assert r.returncode == 0, r.stderr
    assert f"rpc workers: {ep}" in r.stderr.decode()


def test_tensor_split_longer_than_devices_is_usage_error(workers, target_path):
    r = cli(["run", "-m", str(target_path), "--rpc", workers[0].endpoint, "--tensor-split", "1,1,1", "hi"])
    assert "tensor-split" in one_error_line(r, 2)


def test_bench_takes_rpc(workers, target_path):
    r = cli(["bench", "-m", str(target_path), "--rpc", workers[0].endpoint, "--methods", "none,lookup", "--k", "2",
             "-n", "8", "--categories", "code", "--limit", "1"])
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert f"target layers on RPC workers: {workers[0].endpoint}" in r.stderr.decode()


# ------------------------------------------------------------------ failures are one line, never an abort
def test_unreachable_worker_is_one_error_line(target_path):
    port = free_port()  # nothing listens there
    for cmd in (["run", "-m", str(target_path), "--raw", "hi"], ["bench", "-m", str(target_path), "-n", "4"]):
        r = cli([*cmd, "--rpc", f"127.0.0.1:{port}"])
        line = one_error_line(r, 1)
        assert f"127.0.0.1:{port}" in line and "refused" in line


@pytest.mark.parametrize("reply, why", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "not a compatible llama.cpp RPC worker"),
    (b"", "closed the connection"),
    ((28).to_bytes(8, "little") + bytes([6, 0, 0, 0]) + bytes(24), "speaks protocol 6.0.0"),
    ((28).to_bytes(8, "little") + bytes([7, 1, 0, 0]) + bytes(24), "speaks protocol 7.1.0"),
])
def test_not_an_rpc_worker_is_one_error_line(target_path, reply, why):
    fake = FakeServer(reply)
    try:
        r = cli(["run", "-m", str(target_path), "--rpc", fake.endpoint, "--raw", "hi"])
    finally:
        fake.close()
    line = one_error_line(r, 1)
    assert why in line and fake.endpoint in line


def test_abort_message():
    from localspec.llama.aborts import abort_message
    port = free_port()
    line = abort_message("/src/ggml-rpc.cpp:569: Remote RPC server crashed or returned malformed response",
                         [f"127.0.0.1:{port}"])
    assert line.startswith(f"error: RPC worker 127.0.0.1:{port} stopped responding;")
    assert "ggml-rpc.cpp" not in line and "\n" not in line
    assert abort_message("/src/ggml.c:12: GGML_ASSERT(x) failed", []) == "error: llama.cpp aborted: GGML_ASSERT(x) failed"


def test_worker_death_mid_generation_is_one_line_and_keeps_the_answer(target_path):
    """A worker that dies mid-generation is one `error:` line and exit 1, with the streamed answer kept on stdout:
    not llama.cpp's GGML_ABORT, a gdb backtrace (on stdout and stderr) and SIGABRT."""
    local = cli(["run", "-m", str(target_path), "--method", "none", "-n", "200", "--raw", "the cat"])
    assert local.returncode == 0
    w = Worker("--threads", "1")
    try:
        r = subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", str(target_path), "--rpc", w.endpoint,
                              "-c", "4096", "-n", "4000", "--method", "none", "--raw", "the cat"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = r.stdout.read(8)
        w.kill()
        out, err = r.communicate(timeout=60)
    finally:
        w.kill()
    answer = first + out
    err = err.decode()
    assert r.returncode == 1, (r.returncode, err[-3000:])
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines[-1].startswith(f"error: RPC worker {w.endpoint} stopped responding;"), err[-3000:]
    assert len([l for l in lines if l.startswith("error:")]) == 1 and "gdb" not in err and "Traceback" not in err
    assert b"ggml-rpc.cpp" not in answer and b"#0" not in answer  # nothing but the answer on stdout
    full = local.stdout
    k = min(len(answer), len(full) - 1)
    assert len(answer) >= 8 and answer[:k] == full[:k]  # the streamed part is there and is the answer's start


def kill_worker_mid_generation(w, script: str, env=None):
    """Run `script` (it prints "kill" mid-generation, then waits for a line on stdin), kill worker `w` there, let the
    script go on into the dead worker; returns (process, stderr)."""
    try:
        p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        assert p.stdout.readline() == b"kill\n"
        w.kill()
        p.stdin.write(b"\n")
        p.stdin.flush()
        _, err = p.communicate(timeout=60)
    finally:
        w.kill()
    return p, err


def test_abort_hooks_run_before_the_process_dies(tmp_path, target_path):
    w = Worker("--threads", "1")
    flag = tmp_path / "saved"
    script = f"""
import sys
from localspec.llama import aborts
from localspec.core.engine import Engine, GenConfig
aborts.on_abort(lambda: open({str(flag)!r}, "w").write("saved"))
e = Engine.load({str(target_path)!r}, n_ctx=4096, rpc={w.endpoint!r})
for i, ev in enumerate(e.generate(e.raw_prompt("the cat"), GenConfig(method="none", max_tokens=4000))):
    if i == 3:
        print("kill", flush=True)
        sys.stdin.readline()
"""
    p, err = kill_worker_mid_generation(w, script)
    assert p.returncode == 1, err.decode()[-2000:]
    assert flag.read_text() == "saved"
    assert err.decode().strip().startswith(f"error: RPC worker {w.endpoint} stopped responding")


def test_doctor_reports_rpc():
    r = cli(["doctor", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rpc"] is True


def test_a_dying_worker_leaves_the_streamed_answer_in_the_history(tmp_path, target_path):
    """The chat's transcript is saved before the process can die: the history's flush is an abort hook, so the
    pieces below the write throttle are not lost with the process."""
    w = Worker("--threads", "1")
    db = tmp_path / "history.sqlite3"
    script = f"""
import sys
from localspec.store.history import History
from localspec.session import Session
from localspec.core.engine import GenConfig
s = Session({{"model": {str(target_path)!r}, "rpc": {w.endpoint!r}, "method": "none", "ctx_size": 4096}}, quiet=True)
e = s.load()
h = History({str(db)!r})
chat = h.new_chat("the cat")
h.add_message(chat, "user", "the cat")
writer = h.answer(chat)
for i, ev in enumerate(e.generate(e.raw_prompt("the cat"), GenConfig(method="none", max_tokens=4000))):
    writer.append("piece%d " % i)
    if i == 3:
        print("kill", flush=True)
        sys.stdin.readline()
"""
    p, err = kill_worker_mid_generation(w, script, {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg")})
    assert p.returncode == 1, err.decode()[-2000:]
    from localspec.store.history import History

    h = History(db)
    try:
        (chat,) = h.chats()
        answer = h.get(chat.id).messages[-1]
        assert answer["role"] == "assistant" and answer["content"].startswith("piece0 piece1 piece2 piece3 ")
        assert [c.id for c in h.interrupted()] == [chat.id]  # offered again at the next `localspec chat`
    finally:
        h.close()
