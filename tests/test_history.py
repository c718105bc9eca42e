"""Chat history (localspec/history.py), the Markdown/JSON export, `localspec history ...` and resumed chats."""

from __future__ import annotations

from localspec.chatexport import close_fences, open_fence, to_markdown


def test_open_fence_follows_commonmark():
    assert open_fence("no code") is None
    assert open_fence("```python\nx = 1\n```\n") is None
    assert open_fence("```python\nx = 1\n") == "```"
    assert open_fence("````\n```\nstill code\n") == "````"  # a shorter fence does not close a longer one
    assert open_fence("~~~\n```\n") == "~~~"  # nor does the other character
    assert open_fence("```\ncode\n``` trailing\n") == "```"  # a closing fence has nothing after it
    assert open_fence("``` not `a` fence\n") is None  # a backtick info string cannot hold backticks
    assert open_fence("   ```\nindented 3 opens\n") == "```"


def test_close_fences_appends_the_matching_fence_only_when_open():
    assert close_fences("a ```inline``` b") == "a ```inline``` b"
    assert close_fences("```js\nlet x") == "```js\nlet x\n```"
    assert close_fences("~~~~\nx\n") == "~~~~\nx\n~~~~"
    md = to_markdown("t", [{"role": "assistant", "content": "```\nstopped", "state": "stopped"},
                           {"role": "user", "content": "next"}])
    assert open_fence(md) is None and "## assistant (stopped)" in md
