"""Where a run's report files go, and the gate that keeps runs which checked no target from writing any.

Reports belong to runs that used the plugin's targets. The plugin configures the outputs only
when the run has targets and is not collect-only (`configure_outputs`); `OutputGate` then
withdraws them before they are written when collection fails ("file not found") or when no test
ran against a target (an unrelated test file). pytest-html and JUnit XML must be given their
paths at configure time, before either of those is known, hence the gate.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from _pytest.junitxml import xml_key  # where junitxml keeps its LogXML; no public accessor

from pytest_gpuhost.report.jsonfile import JsonWriter
from pytest_gpuhost.run.record import install

__all__ = ["OutputGate", "configure_outputs"]


def configure_outputs(config: pytest.Config, report_dir: Path, name: str) -> None:
    """Send HTML, JUnit XML and JSON to `<dir>/<name>.*` unless the user chose paths."""
    base = report_dir if report_dir.is_absolute() else config.invocation_params.dir / report_dir
    gate = OutputGate(config, base)
    if getattr(config.option, "htmlpath", "unset") is None:
        config.option.htmlpath = str(base / f"{name}.html")
        config.option.self_contained_html = True
        gate.html = config.option.htmlpath
    if getattr(config.option, "xmlpath", "unset") is None:
        config.option.xmlpath = str(base / f"{name}.xml")
        gate.xml = True
    run_record = install(config)
    if run_record is not None:
        gate.json = JsonWriter(base / f"{name}.json", config, run_record)
        config.pluginmanager.register(gate.json, "gpuhost-json")
    config.pluginmanager.register(gate, "gpuhost-output-gate")


class OutputGate:
    """Withdraw the report writers this plugin set up when the run turns out to check no target.

    Only the outputs the plugin chose are withdrawn; a path the user gave (`--html`,
    `--junitxml`) is theirs and is written as pytest-html and junitxml always do.
    """

    def __init__(self, config: pytest.Config, base: Path) -> None:
        self.config = config
        self.base = base
        self.base_existed = base.exists()  # pytest-html creates it when it is configured
        self.html: str | None = None
        self.xml = False
        self.json: JsonWriter | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Generator[None, Any, Any]:
        try:
            return (yield)
        except BaseException:
            self.withdraw()  # "file or directory not found", an interrupted collection
            raise

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        try:
            return (yield)
        finally:
            if session.config.option.collectonly or not self._used_targets():
                self.withdraw()

    def _used_targets(self) -> bool:
        record = self.json.record if self.json is not None else None
        return record is not None and any(t.target for t in record.tests.values())

    def withdraw(self) -> None:
        """Unregister the writers before pytest_sessionfinish, and remove a report dir left empty."""
        pm = self.config.pluginmanager
        if self.json is not None and pm.is_registered(self.json):
            pm.unregister(self.json)
        if self.xml:
            xml = self.config.stash.get(xml_key, None)
            if xml is not None and pm.is_registered(xml):
                pm.unregister(xml)
                del self.config.stash[xml_key]
        if self.html is not None:
            for plugin in pm.get_plugins():
                if str(getattr(plugin, "_report_path", "")) == self.html:  # pytest-html's report
                    pm.unregister(plugin)
        if not self.base_existed:
            try:
                self.base.rmdir()  # only when empty: never another run's files
            except OSError:
                pass
