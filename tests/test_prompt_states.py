"""Prompt states kept on disk and in memory (store/prompt_states.py) and Model.state_bytes/restore_state: a state
restored in another process answers as a cold prefill does, the longest stored prefix is chosen, another model
file, KV type or key is never used, damaged files are skipped and removed, links and pipes at a state's name are
never read or followed, the budget evicts the least recently used, and processes storing at once leave a readable
store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from localspec.store import prompt_states as PS
from localspec.store.prompt_states import MemoryStates, PromptStates, aligned

TEXT = "the cat and the dog and x = y + 1 " * 40
KEY = "test-key"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LOCALSPEC_KV_TYPE", raising=False)
    return tmp_path / "cache"


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 500, n)]


def blob(n: int, tag: int = 0) -> bytes:
    return bytes([tag % 256]) * n


def greedy(model, context: list[int], n: int) -> list[int]:
    logits, out = model.sync(context), []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = model.decode([t])[0]
    return out


def state_files(cache: Path) -> list[Path]:
    return sorted((cache / PS.FOLDER).glob("*.state"))


# ------------------------------------------------------------------ on the tiny model
RESTORE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from localspec.llama.model import Model
    from localspec.store.prompt_states import PromptStates, state_key
    path, prompt = sys.argv[1], json.loads(sys.argv[2])
    with Model(path, n_ctx=1024) as m:
        hit = PromptStates().longest(state_key(m), prompt)
        ok = hit is not None and m.restore_state(prompt[:hit[0]], hit[1])
        logits, out = m.sync(prompt), []
        for _ in range(30):
            t = int(np.argmax(logits)); out.append(t); logits = m.decode([t])[0]
        print(json.dumps({"n": hit[0] if hit else 0, "ok": ok, "reused": m.reused, "tokens": out}))
""")


def test_a_state_restored_in_another_process_answers_as_a_cold_prefill(target_path, cache):
    from localspec.llama.model import Model
    from localspec.store.prompt_states import state_key

    with Model(target_path, n_ctx=1024) as m:
        prompt = m.tokenize(TEXT)[:300]
        n = aligned(len(prompt))
        assert n == 256
        m.decode(prompt[:n], [])
        data = m.state_bytes()
        assert data and PromptStates().put(state_key(m), prompt[:n], data, label=m.name)
        m.clear()
        cold = greedy(m, prompt, 30)
    assert (os.stat(cache / PS.FOLDER).st_mode & 0o777) == 0o700
    assert [f.stat().st_mode & 0o777 for f in state_files(cache)] == [0o600]
    out = subprocess.run([sys.executable, "-c", RESTORE_SCRIPT, str(target_path), json.dumps(prompt)],
                         capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] == 256 and got["ok"] and got["reused"] == 256
    assert got["tokens"] == cold
    assert PromptStates().summary()["models"] == {target_path.name: 1}


def test_restore_state_in_a_second_model_and_its_refusals(target_path, cache, monkeypatch):
    from localspec.llama.model import Model

    with Model(target_path, n_ctx=1024) as a, Model(target_path, n_ctx=1024) as b:
        prompt = a.tokenize(TEXT)[:200]
        a.decode(prompt[:128], [])
        data = a.state_bytes()
        cold = greedy(a, prompt, 20)
        assert b.restore_state(prompt[:128], data) and b.tokens == prompt[:128]
        assert greedy(b, prompt, 20) == cold and b.reused == 128
        # bytes of another token count, cut short, or none: refused, the cache left empty
        for tokens, bad in ((prompt[:127], data), (prompt[:128], data[:-7]), (prompt[:128], b"")):
            b.decode(prompt[:5], [])
            assert not b.restore_state(tokens, bad)
            assert b.tokens == [] and greedy(b, prompt, 20) == cold
    monkeypatch.setenv("LOCALSPEC_KV_TYPE", "f16")
    with Model(target_path, n_ctx=1024) as f16:
        assert f16.kv_type == "f16"
        assert not f16.restore_state(prompt[:128], data)  # a bf16 state: llama.cpp refuses the other KV type
        assert f16.tokens == []


def test_another_model_file_or_kv_type_has_another_key(target_path, draft_path, cache, tmp_path, monkeypatch):
    from localspec.llama.model import Model
    from localspec.store.prompt_states import state_key

    copy = tmp_path / "copy.gguf"
    shutil.copyfile(target_path, copy)
    keys = {}
    with Model(target_path, n_ctx=1024) as m:
        prompt = m.tokenize(TEXT)[:200]
        m.decode(prompt[:128], [])
        keys["target"] = state_key(m)
        assert state_key(m) == keys["target"]  # stable
        assert PromptStates().put(keys["target"], prompt[:128], m.state_bytes())
    for name, path in (("draft", draft_path), ("copy", copy)):
        with Model(path, n_ctx=1024) as m:
            keys[name] = state_key(m)
    monkeypatch.setenv("LOCALSPEC_KV_TYPE", "f16")
    with Model(target_path, n_ctx=1024) as m:
        keys["f16"] = state_key(m)
    monkeypatch.delenv("LOCALSPEC_KV_TYPE")
    with Model(target_path, n_ctx=1024, n_threads=1) as m:
        keys["threads"] = state_key(m)
    assert len(set(keys.values())) == len(keys)
    store = PromptStates()
    assert store.longest(keys["target"], prompt) is not None
    for name in ("draft", "copy", "f16", "threads"):
        assert store.longest(keys[name], prompt) is None, name
    # the same file's bytes replaced in place (size kept, time moved back): another model
    st = copy.stat()
    raw = bytearray(copy.read_bytes())
    raw[-1] ^= 1
    copy.write_bytes(bytes(raw))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    with Model(copy, n_ctx=1024) as m:
        assert state_key(m) != keys["copy"]


def test_recurrent_models_keep_no_state(hybrid_path, cache):
    from localspec.llama.model import Model

    with Model(hybrid_path, n_ctx=512, n_threads=1) as m:
        prompt = m.tokenize(TEXT)[:130]
        m.decode(prompt, [])
        assert m.rollback_kind != "kv"
        assert m.state_bytes() == b""
        assert not m.restore_state(prompt, b"x" * 1000)
        assert m.tokens == prompt  # refused without touching the cache


# ------------------------------------------------------------------ the store alone
def test_the_longest_stored_prefix_is_chosen(cache):
    store = PromptStates()
    t = toks(400)
    assert not store.put(KEY, t[:64], blob(100))  # under MIN_TOKENS
    assert not store.put(KEY, t[:130], blob(100))  # not block-aligned
    for n in (128, 256, 192):
        assert store.put(KEY, t[:n], blob(1000, n))
    assert store.longest(KEY, t) == (256, blob(1000, 256))
    assert store.longest(KEY, t[:255]) == (192, blob(1000, 192))
    assert store.longest(KEY, t, longer_than=256) is None
    other = list(t)
    other[200] += 1  # diverges inside the fourth block
    assert store.longest(KEY, other) == (192, blob(1000, 192))
    other[100] += 1  # inside the second: no stored prefix
    assert store.longest(KEY, other) is None
    assert store.longest("another key", t) is None
    assert store.longest(KEY, t[:127]) is None
    s = store.summary()
    assert s["count"] == 3 and s["bytes"] == sum(f.stat().st_size for f in state_files(cache))
    assert store.clear() == 3 and store.longest(KEY, t) is None and store.summary()["count"] == 0


def test_memory_layer_in_front_of_the_disk(cache):
    disk = PromptStates()
    mem = MemoryStates(budget=2500, below=disk)
    t = toks(400)
    assert mem.put(KEY, t[:128], blob(1000, 1))
    assert mem.put(KEY, t[:192], blob(1000, 2))
    assert mem.longest(KEY, t) == (192, blob(1000, 2))
    for f in state_files(cache):
        f.unlink()
    assert mem.longest(KEY, t) == (192, blob(1000, 2))  # from memory
    assert mem.put(KEY, t[:256], blob(1000, 3))  # the 128 one leaves memory (budget 2500)
    assert mem.bytes <= 2500 and len(mem._items) == 2
    assert disk.put(KEY, t[:320], blob(1000, 4))  # another process stores a longer one
    assert mem.longest(KEY, t) == (320, blob(1000, 4))
    assert mem.longest("another key", t) is None
    mem.clear()
    assert mem.longest(KEY, t) is None and mem.bytes == 0


@pytest.mark.parametrize("damage", ["truncated", "payload bit", "token bit", "header bit", "foreign", "empty"])
def test_a_damaged_file_is_skipped_and_removed(cache, damage):
    store = PromptStates()
    t = toks(300)
    assert store.put(KEY, t[:128], blob(5000, 1))
    assert store.put(KEY, t[:256], blob(5000, 2))
    kd = PS._key_digest(KEY)
    newest = cache / PS.FOLDER / PS._name(kd, PS._chain(kd, t[:256])[-1])
    raw = bytearray(newest.read_bytes())
    head = PS._PREFIX.size + PS._PREFIX.unpack_from(raw)[2]
    if damage == "truncated":
        raw = raw[:-100]
    elif damage == "payload bit":
        raw[-10] ^= 0x04
    elif damage == "token bit":
        raw[head + 4 * 200] ^= 0x01
    elif damage == "header bit":
        raw[PS._PREFIX.size + 10] ^= 0x20
    elif damage == "foreign":
        raw = bytearray(os.urandom(len(raw)))
    else:
        raw = bytearray()
    newest.write_bytes(bytes(raw))
    assert store.longest(KEY, t) == (128, blob(5000, 1))
    assert not newest.exists()
    assert store.notes
    assert store.longest(KEY, t) == (128, blob(5000, 1))


def test_the_budget_evicts_the_least_recently_used(cache):
    size = len(PS.encode(KEY, toks(128), blob(10_000)))
    store = PromptStates(budget=2 * size + 100)
    a, b, c = toks(128, 1), toks(128, 2), toks(128, 3)
    assert store.put(KEY, a, blob(10_000, 1))
    assert store.put(KEY, b, blob(10_000, 2))
    for f in state_files(cache):  # mtimes a second apart: the order is the store's, not the file system's
        os.utime(f, (1_000_000, 1_000_000))
    assert store.longest(KEY, a) == (128, blob(10_000, 1))  # a is now the most recently used
    assert store.put(KEY, c, blob(10_000, 3))
    assert store.longest(KEY, b) is None
    assert store.longest(KEY, a) is not None and store.longest(KEY, c) is not None
    assert sum(f.stat().st_size for f in state_files(cache)) <= store.budget
    assert not store.put(KEY, toks(192, 4), blob(3 * size))  # larger than the whole budget: not stored
    assert len(state_files(cache)) == 2


STORE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from localspec.store.prompt_states import PromptStates
    seed, budget = int(sys.argv[1]), int(sys.argv[2])
    store = PromptStates(budget=budget)
    for i in range(12):
        t = [int(x) for x in np.random.default_rng(seed * 100 + i).integers(0, 500, 128)]
        assert store.put("test-key", t, bytes([i]) * 200_000)
""")


def test_two_processes_storing_at_once_leave_a_readable_store(cache):
    size = len(PS.encode(KEY, toks(128), blob(200_000)))
    budget = 5 * size
    procs = [subprocess.Popen([sys.executable, "-c", STORE_SCRIPT, str(seed), str(budget)], env=os.environ.copy(),
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    files = state_files(cache)
    assert 0 < len(files) and sum(f.stat().st_size for f in files) <= budget
    assert not [f for f in (cache / PS.FOLDER).iterdir() if f.name.endswith(".tmp")]
    store = PromptStates(budget=budget)
    found = 0
    for seed in (1, 2):
        for i in range(12):
            t = [int(x) for x in np.random.default_rng(seed * 100 + i).integers(0, 500, 128)]
            hit = store.longest(KEY, t)
            if hit is not None:
                assert hit == (128, bytes([i]) * 200_000)
                found += 1
    assert found == len(files) and not store.notes


def test_clear_removes_only_its_own_files(cache):
    store = PromptStates()
    t = toks(200)
    assert store.put(KEY, t[:128], blob(100))
    own = cache / PS.FOLDER
    (own / "notes.txt").write_text("mine")
    (own / ("0" * 16 + "-" + "0" * 32 + ".state")).mkdir()  # a folder at an own name: kept
    (own / ".0123456789abcdef-0123456789abcdef0123456789abcdef.state.0123456789ab.tmp").write_bytes(b"x")
    assert store.clear() == 2
    assert sorted(p.name for p in own.iterdir()) == ["0" * 16 + "-" + "0" * 32 + ".state", "notes.txt"]
    assert store.longest(KEY, t) is None


def test_links_and_pipes_at_a_state_name_are_never_read_or_followed(cache, tmp_path):
    store = PromptStates()
    t = toks(200)
    assert store.put(KEY, t[:128], blob(100, 7))
    (path,) = state_files(cache)
    outside = tmp_path / "outside.state"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    assert store.longest(KEY, t) is None
    assert path.is_symlink() and outside.read_bytes()  # neither removed nor followed
    assert not store.put(KEY, t[:128], blob(100, 8))  # never written through the link
    assert PS.decode_file(outside.read_bytes(), KEY, t[:128]) == blob(100, 7)
    path.unlink()
    os.mkfifo(path)
    assert store.longest(KEY, t) is None  # a pipe: not opened (a read would block)
    assert not store.put(KEY, t[:128], blob(100))
    assert path.exists() and not path.is_file()
    assert store.summary()["count"] == 0
    # the folder itself a link: nothing read or written through it
    shutil.rmtree(cache / PS.FOLDER)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (cache / PS.FOLDER).symlink_to(elsewhere)
    assert not store.put(KEY, t[:128], blob(100))
    assert store.longest(KEY, t) is None and list(elsewhere.iterdir()) == []
    assert store.clear() == 0
