"""The lab's emulated tools start without json and re (6-7 ms of CPU per start), and read JSON as json does."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "gpulab" / "tools"
# loaded from its file: gpulab/tools (which also holds an `sglang` stand-in) stays off sys.path
_spec = importlib.util.spec_from_file_location("gpulab_tools", TOOLS / "gpulab_tools" / "__init__.py")
assert _spec is not None and _spec.loader is not None
gpulab_tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpulab_tools)


def test_tools_start_without_json_and_re() -> None:
    """What nvidia-smi and dmesg import before they read anything (python3 -S, as they start)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import gpulab_tools.nvidia_smi; "
        "print(sorted(m for m in ('json', 're', 'enum', 'collections') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code, str(TOOLS)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


CORPUS = [
    {"a": [1, 2.5, -3e-7, 10**30, True, False, None], "b": {"c": 'd\u00e9\n"\\/\t'}, "": []},
    [],
    {},
    "plain",
    "\ud83d\ude00 emoji and \u2028",
    0,
    -0.0,
    1.5e308,
    [{"bdf": "0000:17:00.0", "link": {"speed": "32.0 GT/s PCIe", "width": 16}}] * 3,
]
TEXTS = (
    [json.dumps(v) for v in CORPUS]
    + [json.dumps(v, indent=1) for v in CORPUS]
    + [
        ' \n\t{"x": 1}\r\n ',
        "[NaN, Infinity, -Infinity]",
        "1e400",
        '"\\ud83d\\ude00"',
        '{"a": 1, "a": 2}',
    ]
)


@pytest.mark.parametrize("text", TEXTS)
def test_loads_is_json_loads(text: str) -> None:
    got, want = gpulab_tools.loads(text), json.loads(text)
    assert json.dumps(got) == json.dumps(want)  # NaN != NaN: compare the encodings
    assert type(got) is type(want)


def test_loads_bad_json_raises_valueerror() -> None:
    for bad in ["", "   ", "{", "[1,]", "1 2", "\ufeff{}", "nul", "{'a': 1}", '{"a" 1}', '"\\x"']:
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            gpulab_tools.loads(bad)


def test_every_profile_reads_the_same(tmp_path: Path) -> None:
    """The profiles as the lab writes them for its hosts (profile.json) read back identically."""
    from gpulab.profiles.load import load_profile

    for prof in sorted((ROOT / "fixtures" / "profiles").glob("*.yaml")):
        text = load_profile(prof.stem).to_json()
        assert gpulab_tools.loads(text) == json.loads(text), prof.stem


def _speed_gen_re(speed: str) -> int:  # the regex version it replaced
    m = re.match(r"([\d.]+)", speed or "")
    gts = float(m.group(1)) if m else 0.0
    for gen, v in ((6, 64.0), (5, 32.0), (4, 16.0), (3, 8.0), (2, 5.0), (1, 2.5)):
        if gts >= v:
            return gen
    return 1


def test_speed_gen_without_re() -> None:
    for s in [
        "32.0 GT/s PCIe",
        "",
        "2.5 GT/s",
        "16 GT/s",
        "8.0GT/s",
        "abc",
        "64.0 GT/s PCIe",
        "\u0663\u0662.0 GT/s",
        "0",
    ]:
        assert gpulab_tools.speed_gen(s) == _speed_gen_re(s), s
    for s in ["1.2.3 GT/s", ". GT/s"]:
        with pytest.raises(ValueError):
            _speed_gen_re(s)
        with pytest.raises(ValueError):
            gpulab_tools.speed_gen(s)
    assert math.isclose(gpulab_tools.loads("2.5"), 2.5)
