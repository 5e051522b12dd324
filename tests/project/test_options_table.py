"""Options are declared once, as data: one table per owner, each default in one place, one reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.targets import TargetOptions
from pytest_gpuhost.run import options, settings
from suites.accept import options as accept_options
from suites.accept.options import AcceptOptions
from suites.decommission import options as decommission_options
from suites.health import options as health_options
from suites.p2p import options as p2p_options
from suites.p2p.options import P2POptions

ROOT = Path(__file__).resolve().parents[2]

TABLES = {
    "plugin": settings.OPTIONS,
    "p2p": p2p_options.OPTIONS,
    "decommission": decommission_options.OPTIONS
    + decommission_options.TUNING
    + decommission_options.INI_ONLY,
    "health": health_options.OPTIONS,
    "accept": accept_options.OPTIONS,
}
ALL = [opt for table in TABLES.values() for opt in table]


def test_flags_ini_names_and_dests_are_unique_across_every_table() -> None:
    flags = [o.flag for o in ALL if o.flag]
    names = [o.name for o in ALL]
    dests = [o.attr for o in ALL if o.flag]
    assert len(set(flags)) == len(flags) and len(set(names)) == len(names) and len(set(dests)) == len(dests)


def test_help_texts_show_the_tables_defaults_and_write_no_number_of_their_own() -> None:
    for opt in ALL:
        # A number written into the help would drift from the default the code uses.
        assert not re.search(r"default [0-9]", opt.help), opt.help
        if "{default}" in opt.help:
            assert f"default {options.show_default(opt.default)}" in opt.help_text, opt.help_text
    by_flag = {o.flag: o for o in ALL}
    assert "(default 60)" in by_flag["--command-timeout"].help_text
    assert "(default 20)" in by_flag["--stop-timeout"].help_text
    assert "(default 0.5)" in by_flag["--p2p-min-fraction"].help_text


def test_defaults_come_from_the_dataclasses_that_use_them() -> None:
    by_flag = {o.flag: o for o in ALL}
    exec_defaults = TargetOptions()
    assert by_flag["--command-timeout"].default == exec_defaults.command_timeout
    assert by_flag["--connect-timeout"].default == exec_defaults.connect_timeout
    assert by_flag["--host-key-policy"].default == exec_defaults.host_key_policy
    p2p = P2POptions()
    assert by_flag["--stop-timeout"].default == p2p.stop_timeout
    assert by_flag["--p2p-min-fraction"].default == p2p.fraction
    assert by_flag["--health-port"].default == p2p.health_port
    assert by_flag["--health-timeout"].default == p2p.health_timeout
    accept = AcceptOptions()
    for opt in accept_options.OPTIONS:  # every default written once, in the dataclass
        assert opt.default == getattr(accept, opt.name.removeprefix("accept_")), opt.name
    assert by_flag["--p2p-unbind-timeout"].default == p2p.unbind_timeout
    assert by_flag["--p2p-lock-wait"].default == p2p.lock_wait


def test_only_the_reader_declares_options_or_reads_ini_values() -> None:
    """Every option is registered through `options.register` and read through `options.read`."""
    calls = re.compile(r"\b(parser|group|config)\.(addoption|addini|getini)\(")
    offenders = []
    for path in sorted([*(ROOT / "pytest_gpuhost").rglob("*.py"), *(ROOT / "suites").rglob("*.py")]):
        if path == ROOT / "pytest_gpuhost" / "run" / "options.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if calls.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def test_parsers_say_what_they_expected() -> None:
    assert options.number(1, 10, integer=True)("7") == 7
    for bad, why in (("x", "not a number"), ("11", "out of range"), ("2.5", "not a whole number")):
        with pytest.raises(options.BadValue, match=why):
            options.number(1, 10, integer=True)(bad)
    with pytest.raises(options.BadValue, match="choose one of a, b"):
        options.choice("a", "b")("c")
    assert options.lines(["a,b", " c "]) == ["a", "b", "c"] and options.lines("a\nb") == ["a", "b"]
    assert options.boolean("Yes") is True and options.boolean("off") is False
    with pytest.raises(options.BadValue, match="greater than 0"):
        options.seconds("-1")
    assert issubclass(options.BadValue, GpuhostError)


def test_an_error_names_the_option_the_value_its_source_and_the_fix() -> None:
    opt = health_options.FIX
    src = options.Source(opt, "ini", ["persistence", "reboot"], "/srv/tox.ini")
    assert str(src.error("unknown fix; choose from x", raw="reboot")) == (
        "gpuhost: ini health_fix='reboot': unknown fix; choose from x (from /srv/tox.ini)"
    )
    assert str(options.Source(opt, "command line", ["x"]).error("why")) == "gpuhost: --fix=['x']: why"
    tuning = decommission_options.STALL_TIMEOUT
    assert str(options.Source(tuning, "default", 60.0)) == "ini decommission_stall_timeout"


SUITES_CONFTEST = """
from suites.conftest import pytest_addoption, pytest_configure
"""


def test_given_nothing_every_value_is_its_tables_default(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SUITES_CONFTEST)
    pytester.makepyfile(
        """
        from dataclasses import replace
        from pytest_gpuhost.run import settings
        from suites.accept.options import AcceptOptions
        from suites.accept.suite import SUITE as ACCEPT
        from suites.decommission import options as decommission_options
        from suites.health import options as health_options
        from suites.decommission.suite import SUITE as DECOMMISSION
        from suites.p2p.options import P2POptions
        from suites.p2p.suite import SUITE as P2P

        def test_defaults(pytestconfig):
            s = settings.read(pytestconfig)
            for opt in settings.OPTIONS:
                key = opt.name.removeprefix("gpuhost_")
                want = list(opt.default) if opt.kind == "list" else opt.default
                if key == "report_name":
                    continue  # filled with the run's default name at configure time
                assert getattr(s, key) == want, key
                assert s.sources[key].origin == "default"
            assert P2P.settings(pytestconfig) == P2P.per_target(P2POptions(), {})
            decom = DECOMMISSION.settings(pytestconfig)
            for opt in decommission_options.TUNING:
                assert getattr(decom, opt.name.removeprefix("decommission_")) == opt.default
            assert decom.backup_dir == "backups/{host}" and decom.fixes == ()
            assert health_options.fixes(pytestconfig) == []
            assert ACCEPT.settings(pytestconfig) == AcceptOptions()
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_command_line_wins_over_ini_over_default_and_says_so(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SUITES_CONFTEST)
    pytester.makeini(
        "[pytest]\ngpuhost_command_timeout = 5\np2p_stop_timeout = 7\nhealth_fix =\n    service\n"
        "gpuhost_report_dir = none\n"
    )
    pytester.makepyfile(
        """
        from pytest_gpuhost.run import options, settings
        from suites.health import options as health_options
        from suites.p2p import options as p2p_options
        from suites.p2p.suite import SUITE as P2P

        def test_sources(pytestconfig):
            s = settings.read(pytestconfig)
            assert s.command_timeout == 3.0 and str(s.sources["command_timeout"]) == "--command-timeout"
            assert str(s.sources["connect_timeout"]) == "default --connect-timeout"
            (stop,) = [o for o in p2p_options.OPTIONS if o.flag == "--stop-timeout"]
            value, source = options.read(pytestconfig, stop)
            assert value == 7.0 and str(source) == "ini p2p_stop_timeout"
            assert source.file.endswith("tox.ini")
            assert health_options.fixes(pytestconfig) == ["service"]
            assert P2P.settings(pytestconfig).stop_timeout == 7.0
        """
    )
    pytester.runpytest("-p", "no:cacheprovider", "--command-timeout=3").assert_outcomes(passed=1)
    result = pytester.runpytest("-p", "no:cacheprovider", "-o", "p2p_stop_timeout=soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: gpuhost: ini p2p_stop_timeout='soon': not a number; *(from -o on the command line)"]
    )
