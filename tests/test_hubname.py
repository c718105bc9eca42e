"""models/hubname.py: models by hub name: hf://OWNER/REPO/FILE.gguf, OWNER/REPO[:QUANT], hf.co/… against the fake hub."""

import json
import os
import subprocess
import sys

import pytest

from fakehub import FakeHub
from localspec.models import download
from localspec.models import hubname as hfname
from localspec.models import registry
from localspec.errors import DownloadError, UsageError
from localspec.models.hubname import HubName, RepoFile, parse, pick

REPO = "test/tiny-GGUF"


# ---------------------------------------------------------------- parsing and picking (pure)
@pytest.mark.parametrize("text, want", [
    ("hf://a/b/c.gguf", HubName("a/b", file="c.gguf")),
    ("hf://a/b/sub/c.gguf@v1", HubName("a/b", file="sub/c.gguf", revision="v1")),
    ("a/b", HubName("a/b")),
    ("a/b:q8_0", HubName("a/b", quant="q8_0")),
    ("bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M", HubName("bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF", quant="Q4_K_M")),
    ("hf.co/a/b:IQ4_XS", HubName("a/b", quant="IQ4_XS")),
    ("huggingface.co/a/b", HubName("a/b")),
    ("https://huggingface.co/a/b/blob/main/m-Q8_0.gguf", HubName("a/b", file="m-Q8_0.gguf", revision="main")),
    ("hf://a/b:Q8_0@dev", HubName("a/b", quant="Q8_0", revision="dev")),
    ("models/x.gguf", None),  # ends in .gguf: a path
    ("./a/b", None),
    ("a/b/c", None),  # two slashes without hf://: a path
    ("qwen2.5-coder-1.5b", None),
])
def test_parse(text, want):
    assert parse(text) == want


@pytest.mark.parametrize("bad", ["hf://a", "hf://a/b c", "hf.co/a b/c:d", "hf://a/b/c.gguf@"])
def test_parse_malformed_prefixed_names(bad):
    with pytest.raises(UsageError, match="expected hf://OWNER/REPO/FILE.gguf"):
        parse(bad)


FILES = [RepoFile(p) for p in (
    "README.md", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-F16.gguf",
    "F16/tiny-F16-00001-of-00002.gguf", "F16/tiny-F16-00002-of-00002.gguf", "tiny-IQ4_XS.gguf",
    "Q6_K/tiny-Q6_K-00001-of-00002.gguf", "Q6_K/tiny-Q6_K-00002-of-00002.gguf", "tiny-Q6_K.gguf",
)]


def test_pick_by_quant():
    assert pick(FILES, REPO).path == "tiny-Q4_K_M.gguf"  # the default
    assert pick(FILES, REPO, "q8_0").path == "tiny-Q8_0.gguf"  # case-insensitive
    assert pick(FILES, REPO, "Q4_K_S").path == "tiny-Q4_K_S.gguf"  # a quant, not a prefix of Q4_K_M's name
    assert pick(FILES, REPO, "iq4_xs").path == "tiny-IQ4_XS.gguf"
    assert pick(FILES, REPO, "Q6_K").path == "tiny-Q6_K.gguf"  # one file beats split parts
    with pytest.raises(UsageError, match=r"split into 2 parts .*not supported yet"):
        pick(FILES, REPO, "F16")  # the mmproj F16 is a vision projector, not this model
    with pytest.raises(UsageError) as e:
        pick(FILES, REPO, "Q5_K_M")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{REPO} has no Q5_K_M GGUF; choose one of: ")
    assert msg.endswith(f"{REPO}:F16, {REPO}:IQ4_XS, {REPO}:Q4_K_M, {REPO}:Q4_K_S, {REPO}:Q6_K, {REPO}:Q8_0")
    with pytest.raises(UsageError, match="no GGUF files"):
        pick([RepoFile("model.safetensors")], REPO)
    # no Q4_K_M: a repo holding one model is taken as is, several need a quant
    assert pick([RepoFile("m-Q8_0.gguf")], REPO).path == "m-Q8_0.gguf"
    with pytest.raises(UsageError, match=r"no Q4_K_M GGUF \(the default\); choose one of: .*:Q8_0"):
        pick([RepoFile("m-Q8_0.gguf"), RepoFile("m-Q6_K.gguf")], REPO)
    with pytest.raises(UsageError, match="matches 2 files; name one: hf://"):
        pick([RepoFile("a-Q8_0.gguf"), RepoFile("b-Q8_0.gguf")], REPO, "Q8_0")


def test_name_kinds(tmp_path, monkeypatch):
    """A file is a path; a pair name wins over a hub name; A/B is a repo; a missing x/y.gguf is a path."""
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "model").write_bytes(b"x")
    assert registry.resolve_name("owner/model")[0] == "path"
    assert registry.resolve_name("owner/other") == ("hub", HubName("owner/other"))
    assert registry.resolve_name("qwen2.5-coder-1.5b")[0] == "pair"
    assert registry.resolve_name("owner/x.gguf")[0] == "path"
    assert not registry.looks_like_path("owner/other:Q8_0") and registry.looks_like_path("owner/x.gguf")
    with pytest.raises(UsageError, match="unknown model pair"):
        registry.resolve_name("nosuchpair")


def test_settings_and_tune_key_accept_hub_names(tmp_path, monkeypatch):
    from localspec.session import resolve_settings, tuned_key

    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    s = resolve_settings({"model": "hf.co/a/b:q8_0"})
    assert s["model"].value == "hf.co/a/b:q8_0" and s["draft_tokens"].source == "default"
    assert tuned_key("hf.co/a/b:q8_0", None) == "a/b:Q8_0"
    assert tuned_key("a/b", None) == "a/b:Q4_K_M"


# ---------------------------------------------------------------- against the fake hub
@pytest.fixture
def hub(env, monkeypatch, target_path, draft_path, no_vocab_path):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        h.add_file("test/tiny", "target.gguf", target_path.read_bytes())
        h.add_file("test/tiny", "draft.gguf", draft_path.read_bytes())
        h.add_file("test/tiny", "other.gguf", no_vocab_path.read_bytes())
        h.add_file(REPO, "README.md", b"# tiny\n")
        h.add_file(REPO, "tiny-Q4_K_M.gguf", target_path.read_bytes())
        h.add_file(REPO, "tiny-Q8_0.gguf", draft_path.read_bytes())
        h.add_file(REPO, "F16/tiny-F16-00001-of-00002.gguf", b"part1")
        h.add_file(REPO, "F16/tiny-F16-00002-of-00002.gguf", b"part2")
        yield h


def bodies(hub):
    """GETs of whole files (not ranged header reads, not listings)."""
    return [l for l in hub.log if l[0] == "GET" and "/resolve/" in l[1] and not l[2]]


def test_repo_quant_resolution_on_the_hub(hub):
    spec = hfname.resolve(parse(REPO))
    assert (spec.repo, spec.file, spec.revision) == (REPO, "tiny-Q4_K_M.gguf", None)
    assert any(l[1].startswith(f"/api/models/{REPO}/tree/main") for l in hub.log)  # the hub's file listing
    assert hfname.resolve(parse(f"hf.co/{REPO}:q8_0")).file == "tiny-Q8_0.gguf"
    with pytest.raises(UsageError, match=rf"no Q5_K_M GGUF; choose one of: {REPO}:F16, {REPO}:Q4_K_M, {REPO}:Q8_0$"):
        hfname.resolve(parse(f"{REPO}:Q5_K_M"))
    with pytest.raises(UsageError, match="split into 2 parts"):
        hfname.resolve(parse(f"{REPO}:F16"))
    with pytest.raises(UsageError, match="no model repo test/nope"):
        hfname.resolve(parse("test/nope:Q8_0"))
    assert bodies(hub) == []  # choosing a file downloads nothing


def test_offline_resolution_from_the_cache(hub, monkeypatch):
    p = download.ensure(hfname.resolve(parse(REPO)), quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    spec = hfname.resolve(parse(REPO))
    assert spec.file == "tiny-Q4_K_M.gguf" and download.ensure(spec, quiet=True) == p
    with pytest.raises(UsageError, match=rf"no Q8_0 GGUF; choose one of: {REPO}:Q4_K_M$"):
        hfname.resolve(parse(f"{REPO}:Q8_0"))  # offline, only what is cached counts
    with pytest.raises(DownloadError, match="test/other is not in the local cache and HF_HUB_OFFLINE=1"):
        hfname.resolve(parse("test/other"))
    assert hub.log == []  # offline means offline
    # online but the hub is down: the cache answers too
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert hfname.resolve(parse(REPO)).file == "tiny-Q4_K_M.gguf"


def cli(args, env_extra=None):
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env_extra or {})}, timeout=120)


def test_hub_names_in_run(hub):
    r = cli(["run", "-m", f"hf.co/{REPO}", "-d", "hf://test/tiny/draft.gguf", "--method", "draft",
             "-n", "4", "--json", "--raw", "hi"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "tiny-Q4_K_M.gguf" and out["draft"] == "draft.gguf" and out["draft_dropped"] is None
    r = cli(["run", "-m", f"{REPO}:Q8_0", "--method", "none", "-n", "2", "--json", "--raw", "hi"])
    assert r.returncode == 0 and json.loads(r.stdout)["target"] == "tiny-Q8_0.gguf"
    r = cli(["run", "-m", f"{REPO}:Q3_K_M", "hi"])
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1
    assert r.stderr.decode().startswith(f"error: {REPO} has no Q3_K_M GGUF; choose one of: {REPO}:F16")
    r = cli(["run", "-m", "hf://test/tiny/draft.gguf", "-n", "2", "--json", "--raw", "hi"], {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and json.loads(r.stdout)["target"] == "draft.gguf"  # cached by the first run


def test_incompatible_hub_pair_refused_before_download(hub):
    r = cli(["run", "-m", "hf://test/tiny/target.gguf", "-d", "hf://test/tiny/other.gguf", "--method", "draft", "hi"])
    assert r.returncode == 2, r.stderr
    err = r.stderr.decode()
    assert err.startswith("error: draft other.gguf cannot speculate for target.gguf: ") and "nothing was downloaded" in err
    assert [l for l in hub.log if l[0] == "GET"] and bodies(hub) == []  # only ranged header reads
    # auto: the incompatible draft is dropped, and never downloaded
    r = cli(["run", "-m", "hf://test/tiny/target.gguf", "-d", "hf://test/tiny/other.gguf", "-n", "4", "--json", "--raw", "hi"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["draft"] is None and "cannot speculate" in out["draft_dropped"]
    assert [l[1] for l in bodies(hub)] == ["/test/tiny/resolve/main/target.gguf"]


def test_models_add_with_hub_names(hub):
    r = cli(["models", "add", "mine", "--target", f"hf.co/{REPO}", "--draft", f"{REPO}:Q8_0"])
    assert r.returncode == 0, r.stderr
    pair = registry.get("mine")
    assert (pair.target.repo, pair.target.file) == (REPO, "tiny-Q4_K_M.gguf")  # a definite file is stored
    assert pair.draft.file == "tiny-Q8_0.gguf"
    r = cli(["models", "add", "bad", "--target", "hf://test/tiny/target.gguf", "--draft", "hf://test/tiny/other.gguf"])
    assert r.returncode == 0 and b"warning: this draft cannot speculate" in r.stderr  # checked on the headers
    assert bodies(hub) == []


def test_hub_models_pulled_listed_and_removed(hub):
    """`models pull` takes a hub name; the model shows in `models list --local` under that name, and `models rm NAME`
    deletes it."""
    r = cli(["models", "pull", f"{REPO}:Q8_0"])
    assert r.returncode == 0, r.stderr
    p = download.local_path(hfname.resolve(parse(f"{REPO}:Q8_0")))
    assert p is not None and r.stderr.decode().strip().endswith(f"model: {p}")
    rows = json.loads(cli(["models", "list", "--local", "--json"]).stdout)
    assert [(r["name"], r["source"], r["target"]["path"]) for r in rows] == [(f"{REPO}:Q8_0", "hub cache", str(p))]
    r = cli(["models", "rm", f"{REPO}:Q4_K_M", "--yes"])
    assert r.returncode == 2 and r.stderr.decode().startswith(f"error: {REPO}:Q4_K_M is not downloaded")
    r = cli(["models", "rm", f"hf.co/{REPO}:q8_0"])
    assert r.returncode == 2 and b"--yes" in r.stderr and p.exists()
    r = cli(["models", "rm", f"hf.co/{REPO}:q8_0", "--yes"])
    assert r.returncode == 0 and not p.exists()
    assert json.loads(cli(["models", "list", "--local", "--json"]).stdout) == []
    assert bodies(hub) == [("GET", f"/{REPO}/resolve/main/tiny-Q8_0.gguf", None)]  # rm and list stay offline
