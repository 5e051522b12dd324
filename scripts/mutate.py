#!/usr/bin/env python3
"""Break each named safety check in a copy of the tree and require a test to fail.

Every check that protects a host, a backup or a secret is listed below with the tests that guard
it. For each, the checkout is copied to a temporary directory, the one line is changed there (the
checkout itself is never touched), and the guarding tests run against the copy; a mutation that
leaves them green "survived", and the script exits 1. A kill proves something only when the same
tests pass unmutated: every guarding test also runs once, in one session of an unmutated copy (the
control), and the script exits 1 when it fails; `--no-control` leaves the control to a caller
that runs those tests unmutated itself (the full test suite does). `--list` prints the
mutations, `--guards` the guarding tests; names given on the command line run only those.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY = ("pytest_gpuhost", "suites", "gpulab", "tests", "fixtures", "conftest.py", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # what the check protects
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


ROOM_TEST = (
    "tests/decommission/test_decommission_preflight_lab.py::"
    "test_a_backup_dir_without_room_for_the_node_refuses_at_step_one_with_servers_running"
)
CHECK_ONLY_TEST = "tests/engine/test_check_only_writes_nothing_lab.py::"

MUTATIONS = (
    Mutation(
        "arrival-sha256",
        "a copied file takes its final name only when its SHA-256 equals the node's",
        "pytest_gpuhost/modules/backup/writer.py",
        "if digest != node_sha:",
        "if False:",
        ("tests/backup/test_backup_writer.py",),
    ),
    Mutation(
        "reserved-category-names",
        "a category named NOTES.md or SHA256SUMS is refused before the servers are stopped",
        "pytest_gpuhost/modules/backup/manifest.py",
        "elif name.casefold() in {r.casefold() for r in RESERVED}:",
        "elif False:",
        ("tests/backup/test_backup_manifest.py",),
    ),
    Mutation(
        "s3-object-proof",
        "an object no run of ours checked against the node's SHA-256 is not counted as backed up",
        "pytest_gpuhost/modules/backup/s3.py",
        'elif rec is None or rec.get("sha256") != item.sha256:',
        "elif False:",
        ("tests/backup/test_backup_s3.py::test_an_object_this_backup_did_not_verify_is_not_counted",),
    ),
    Mutation(
        "uvm-kernel-holder",
        "a kernel-side nvidia_uvm hold (an unbind would block forever) stops the p2p run",
        "pytest_gpuhost/modules/gpu.py",
        "if isinstance(held, dict) and uvm > 2 * fds:",
        "if False:",
        ("tests/p2p/test_p2p_kernel_refusals.py",),
    ),
    Mutation(
        "uvm-one-ref-per-file",
        "a CUDA process's two references per open /dev/nvidia-uvm never read as a kernel hold",
        "pytest_gpuhost/modules/gpu.py",
        "if isinstance(held, dict) and uvm > 2 * fds:",
        "if isinstance(held, dict) and uvm > fds:",
        ("tests/p2p/test_p2p_kernel_refusals.py",),
    ),
    Mutation(
        "multi-device-group-5.11-6.3",
        "before 6.4 a group of several devices is refused at plan time, driverless members counted",
        "suites/p2p/plan.py",
        "multi = [g for g in plan.groups_to_fix if len(g.members) > 1 and not g.identity]",
        "multi = [g for g in plan.groups_to_fix if len(g.functions) > 1 and not g.identity]",
        ("tests/p2p/test_p2p_plan.py",),
    ),
    Mutation(
        "snp-amd-iommu-pt",
        "amd_iommu=pt (no AMD option) never reads as SNP off, so an SNP host's GPU is not retyped and lost",
        "pytest_gpuhost/modules/iommu.py",
        'return "iommu=pt" in (cmdline or "").split()',
        'return any(w in ("iommu=pt", "amd_iommu=pt") for w in (cmdline or "").split())',
        ("tests/p2p/test_p2p_kernel_refusals.py",),
    ),
    Mutation(
        "in-place-bytes-compared",
        "a file already in S3 counts only when the node's bytes give the object's checksum or ETag",
        "pytest_gpuhost/modules/backup/inplace.py",
        "        if got != need.expect:",
        "        if False:",
        ("tests/backup/test_backup_inplace.py",),
    ),
    Mutation(
        "in-place-sse-etag",
        "an SSE-KMS object's ETag (not an MD5) is never taken for proof",
        "pytest_gpuhost/modules/backup/inplace.py",
        "    if obj.sse is None and _MD5.match(obj.etag):",
        "    if _MD5.match(obj.etag):",
        ("tests/backup/test_backup_inplace.py",),
    ),
    Mutation(
        "in-place-verdict",
        "a file under an in_s3 root not proved there keeps the node from being safe",
        "suites/decommission/notes.py",
        '    problems += [f"not proved where it already is in S3: {md(p)} ({md(why)})" for p, why in in_place_missing]',
        "",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-step-outcomes",
        "a step that failed, would fix or never ran keeps the node from being safe",
        "suites/decommission/notes.py",
        '        if outcome not in ("passed", "fixed"):',
        "        if False:",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-still-running",
        "a server the manifest selects that still runs keeps the node from being safe",
        "suites/decommission/notes.py",
        '    problems += [f"still running: {md(p)}" for p in running]',
        "",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-local-missing",
        "a path not verified in the local backup keeps the node from being safe",
        "suites/decommission/notes.py",
        '    problems += [f"not in the local backup: {md(p)} ({md(why)})" for p, why in local_missing]',
        "",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-s3-missing",
        "an object not verified in S3 keeps the node from being safe",
        "suites/decommission/notes.py",
        '    problems += [f"not in S3: {md(p)} ({md(why)})" for p, why in s3_missing]',
        "",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-s3-unconfigured",
        "categories marked s3 with no --backup-to keep the node from being safe",
        "suites/decommission/notes.py",
        "    if s3_categories and not s3_configured:",
        "    if False:",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "verdict-s3-unreadable",
        "an S3 destination the verdict could not read proves nothing",
        "suites/decommission/notes.py",
        '    problems += [f"S3 not readable: {md(line)}" for line in s3_unreadable]',
        "",
        (
            "tests/decommission/test_decommission_preflight.py::test_the_verdict_lists_an_unreadable_destination_as_one_problem",
        ),
    ),
    Mutation(
        "verdict-open-uploads",
        "a multipart upload left open keeps the node from being safe",
        "suites/decommission/notes.py",
        '    problems += [f"open multipart upload: {md(k)}" for k in open_uploads]',
        "",
        ("tests/decommission/test_decommission_verdict.py",),
    ),
    Mutation(
        "in-s3-send-to-backup-to",
        "with --in-s3-send-to=backup-to, a file not proved in place is owed under --backup-to",
        "suites/decommission/node.py",
        "            items, unverified = [*items, *more], [*unverified, *missing]",
        "            pass",
        (
            "tests/decommission/test_decommission_inplace.py::test_misses_go_under_backup_to_when_asked_on_local",
        ),
    ),
    Mutation(
        "destination-owner",
        "a backup directory another node's run wrote is refused before anything is stopped",
        "pytest_gpuhost/modules/backup/ownership.py",
        "    if not local.usable:",
        "    if False:",
        (
            "tests/decommission/test_decommission_preflight.py::test_a_destination_of_another_node_is_refused_before_anything_stops",
        ),
    ),
    Mutation(
        "owner-record-corrupt",
        "a corrupt or unreadable owner record is not 'no owner': the place is refused, not claimed",
        "pytest_gpuhost/modules/backup/ownership.py",
        "    rec, why = read_record(folder / OWNER_NAME)",
        '    rec, why = read_record(folder / OWNER_NAME)\n    rec = rec if not why else None\n    why = ""',
        ("tests/backup/test_backup_ownership.py::test_a_corrupt_owner_record_is_refused_not_claimed",),
    ),
    Mutation(
        "owner-record-lost",
        "a backup directory whose record is lost is judged by its timeline: another node's is refused",
        "pytest_gpuhost/modules/backup/ownership.py",
        '    if targets == {me.get("target")}:',
        "    if True:",
        ("tests/backup/test_backup_ownership.py::test_a_lost_record_of_another_node_is_refused",),
    ),
    Mutation(
        "owner-identity-clash",
        "the same machine-id with another target name or host key (a cloned image) is refused",
        "pytest_gpuhost/modules/backup/ownership.py",
        "    differ = [f for f in shared if str(theirs.get(f)) != me.get(f)]",
        '    differ = [f for f in shared if f == "machine_id" and str(theirs.get(f)) != me.get(f)]',
        ("tests/backup/test_backup_ownership.py::test_a_cloned_machine_is_refused_by_its_other_name",),
    ),
    Mutation(
        "owner-s3-foreign-objects",
        "a --backup-to prefix with objects but no owner record, that this backup never wrote, is refused",
        "pytest_gpuhost/modules/backup/ownership.py",
        "            if verdict.status == FREE and s3_foreign:",
        "            if False:",
        ("tests/backup/test_backup_ownership.py::test_objects_without_an_owner_record_are_not_claimed",),
    ),
    Mutation(
        "places-by-components",
        "s3://b/p and s3://b/p/x overlap: places are compared component by component",
        "pytest_gpuhost/modules/backup/ownership.py",
        "        return self.parts[:n] == other.parts[:n]",
        "        return self.parts == other.parts",
        ("tests/backup/test_backup_ownership.py",),
    ),
    Mutation(
        "places-overlap-refused",
        "a run whose --backup-to lies inside an in_s3 location is refused before the first step",
        "suites/decommission/suite.py",
        "    if overlaps:",
        "    if False:",
        (
            "tests/backup/test_backup_ownership.py::test_backup_to_inside_an_in_s3_location_is_refused_before_anything",
        ),
    ),
    Mutation(
        "in-s3-not-ours",
        "an object at an in_s3 location this node did not write (the pipeline's, another node's) is never overwritten",
        "suites/decommission/in_s3.py",
        '        if (head.get("Metadata") or {}).get(OWNER_META) == tag:',
        "        if True:",
        (
            "tests/backup/test_backup_ownership.py::test_an_object_at_an_in_s3_location_is_overwritten_only_when_this_node_wrote_it",
        ),
    ),
    Mutation(
        "multipart-own-uploads",
        "only the multipart uploads this backup started are aborted, never another tool's or node's",
        "pytest_gpuhost/modules/backup/s3.py",
        "        return [(key, uid) for key, uid in self.all_open_uploads() if mine.get(uid) == key]",
        "        return self.all_open_uploads()",
        ("tests/backup/test_backup_s3.py::test_upload_verify_rerun_and_multipart_hygiene",),
    ),
    Mutation(
        "in-place-min-proof",
        "a proof in place weaker than --in-s3-min-proof (a CRC32 alone) is not a pass",
        "pytest_gpuhost/modules/backup/inplace.py",
        "    if found and STRENGTH[found[0].strength] >= STRENGTH[min_proof]:",
        "    if found:",
        ("tests/backup/test_backup_inplace_proofs.py",),
    ),
    Mutation(
        "in-place-object-replaced",
        "an object replaced in S3 between the in-place proof and the verdict is proved again",
        "pytest_gpuhost/modules/backup/inplace.py",
        '                and (old.quick[:2] == (f.size, f.mtime_ns) and old.etag == obj["etag"] and old.url == url)',
        "                and (old.quick[:2] == (f.size, f.mtime_ns) and old.url == url)",
        (
            "tests/backup/test_backup_inplace_proofs.py::test_an_object_replaced_after_the_proof_is_proved_again",
        ),
    ),
    Mutation(
        "journal-delete-replay",
        "a state journal's delete record is replayed after a cut: a forgotten item stays forgotten",
        "pytest_gpuhost/modules/backup/state.py",
        '                    self.items.pop(rec["k"], None)',
        "                    pass",
        ("tests/backup/test_backup_state_journal.py",),
    ),
    Mutation(
        "journal-torn-tail",
        "a torn last line of a cut run is dropped, so the next record is not glued onto it and lost",
        "pytest_gpuhost/modules/backup/state.py",
        "        if good != size:",
        "        if False:",
        ("tests/backup/test_backup_state_journal.py",),
    ),
    Mutation(
        "root-link",
        "a root that is a symbolic link (its data not backed up) is a problem of the verdict",
        "pytest_gpuhost/modules/backup/roots.py",
        '        if r["kind"] == "link":',
        "        if False:",
        ("tests/decommission/test_decommission_roots.py::test_root_problems_of_a_walk",),
    ),
    Mutation(
        "root-empty",
        "a root that yields no file is a problem of the verdict unless marked expected_empty",
        "pytest_gpuhost/modules/backup/roots.py",
        '        elif r["n"] == 0 and r["e"] == 0 and r["kind"] in ("dir", "file") and not cat.expected_empty:',
        "        elif False:",
        (
            "tests/decommission/test_decommission_roots.py::test_an_empty_or_missing_root_is_a_problem_unless_expected",
        ),
    ),
    Mutation(
        "root-verdict",
        "the verdict carries the roots' problems (a link root is never 'safe')",
        "suites/decommission/notes.py",
        "        problems += root_problems(run.manifest, full)",
        "        pass",
        (
            "tests/decommission/test_decommission_roots.py::test_a_root_that_is_a_link_is_a_problem_until_followed",
        ),
    ),
    Mutation(
        "kernel-log-new-boot",
        "after a reboot every kernel-log line is new, even one timed before the last run's cursor",
        "pytest_gpuhost/exec/agent/probe_health_kernel.py",
        "    if new_boot:\n        since, seen = None, set()",
        "    if False:\n        since, seen = None, set()",
        ("tests/health/test_health_probe.py::test_probe_parses_the_tools_and_keeps_a_kernel_log_cursor",),
    ),
    Mutation(
        "reset-cut-run-completed",
        "what a cut reset run left stopped (units, persistence) is put back by the next run",
        "suites/health/reset.py",
        "        units_left, gpus_left = cutrun.leftover(theirs)",
        "        units_left, gpus_left = [], []",
        (
            "tests/health/test_health_reset_lab.py::test_a_run_cut_while_the_gpu_is_reset_is_completed_by_the_next",
        ),
    ),
    Mutation(
        "p2p-unset-env-only-when-proven",
        "the service's own NCCL_P2P_DISABLE is unset (drop-in, restart) only once the collective proved P2P",
        "suites/p2p/collective.py",
        "        if not base.ok or base.skip:",
        "        if False:",
        ("tests/p2p/test_p2p_service_env_lab.py::test_option_does_not_unset_when_the_collective_fails",),
    ),
    Mutation(
        "health-nccl-wrong-data",
        "an all-reduce that returns wrong data fails the health check, whatever transport NCCL took",
        "suites/health/test_health_nccl.py",
        "    if first.failure() or wrong:",
        "    if first.failure():",
        ("tests/health/test_health_nccl.py",),
    ),
    Mutation(
        "listing-unlisted-paths",
        "a path in scope the node could not list (unreadable) is an item, never dropped",
        "pytest_gpuhost/modules/backup/verdict.py",
        "    missing = listing.unlisted()",
        "    missing = []",
        ("tests/backup/test_backup_hostile.py::test_unreadable_paths_are_items_and_excludes_drop_them",),
    ),
    Mutation(
        "listing-vanished-paths",
        "a listed file that could not be copied (vanished, unreadable) is an item, never dropped",
        "pytest_gpuhost/modules/backup/verdict.py",
        '            missing.append(Item(f.display, f"not copied: {why}" if why else "never copied"))',
        "            pass",
        (
            "tests/backup/test_backup_hostile.py::test_a_file_that_vanishes_after_the_listing_is_an_item_until_the_rerun",
        ),
    ),
    Mutation(
        "node-ctime-quick-check",
        "a node file changed with its size and mtime put back is hashed again, not trusted",
        "pytest_gpuhost/modules/backup/verdict.py",
        '    return (rec.get("c"), rec.get("i")) == f.identity',
        "    return True",
        ("tests/backup/test_backup_metadata_put_back.py",),
    ),
    Mutation(
        "local-ctime-check",
        "a local copy altered with its size and mtime put back is not counted as verified",
        "pytest_gpuhost/modules/backup/verdict.py",
        '    return (rec.get("lc"), rec.get("li")) == (st.st_ctime_ns, st.st_ino)',
        "    return True",
        ("tests/backup/test_backup_metadata_put_back.py",),
    ),
    Mutation(
        "sender-ctime-changed",
        "a file rewritten while it is read, mtime put back, is reported changed, never placed",
        "pytest_gpuhost/exec/agent/probe_backup.py",
        "            or after.st_ctime_ns != st.st_ctime_ns\n        )",
        "        )",
        ("tests/backup/test_backup_metadata_put_back.py",),
    ),
    Mutation(
        "p2p-foreign-holder",
        "a GPU held by a process the p2p run did not start fails 'gpus released': nothing is unbound",
        "suites/p2p/prepare.py",
        '        if holders:\n            parts.append("held by "',
        '        if False:\n            parts.append("held by "',
        (
            "tests/p2p/test_p2p_causes_lab.py::"
            "test_a_holder_the_run_did_not_start_fails_gpus_released_and_nothing_is_unbound",
        ),
    ),
    Mutation(
        "reset-foreign-holder",
        "a GPU held by a process outside the inventory's services is never reset, nothing stopped",
        "suites/health/holders.py",
        "        elif not ok_unit:",
        "        elif False:",
        (
            "tests/health/test_health_reset_lab.py::test_a_holder_outside_the_inventorys_services_is_named_and_nothing_is_reset",
        ),
    ),
    Mutation(
        "reset-confirmed-by-signals",
        "a reset counts only when the GPU's own signals stop asking for one, not by the exit code",
        "suites/health/reset.py",
        "            if value == 1:\n                out.setdefault(key(bus), []).append(_SIGNAL_TEXT.get(name, name))\n    return out",
        "            pass\n    return out",
        (
            "tests/health/test_health_reset_lab.py::test_a_reset_that_returns_0_but_leaves_the_gpu_in_error_is_not_counted",
        ),
    ),
    Mutation(
        "reset-reboot-only-when-allowed",
        "a node is rebooted after a reset that did not clear the GPU only under --fix=reset,reboot",
        "suites/health/reset.py",
        "        if left and self.allow_reboot:",
        "        if left:",
        (
            "tests/health/test_health_reset_lab.py::test_a_reset_that_returns_0_but_leaves_the_gpu_in_error_is_not_counted",
        ),
    ),
    Mutation(
        "reboot-foreign-holder",
        "a node whose GPU is held by a process outside the inventory's services is never rebooted",
        "suites/health/holders.py",
        "        out.refused.append(",
        "        [].append(",  # the refusal recorded nowhere
        (
            "tests/health/test_health_reboot_lab.py::test_xid_79_on_gpu_3_reboots_the_node_with_its_servers_stopped_and_started",
        ),
    ),
    Mutation(
        "reboot-owed-only-when-allowed",
        "a node that owes a reboot (Xid 79) is rebooted only under --fix=reset,reboot",
        "suites/health/reset.py",
        "            if self.reboots and self.allow_reboot and not refused:\n",
        "            if self.reboots and not refused:\n",
        (
            "tests/health/test_health_reboot_lab.py::test_xid_79_on_gpu_3_reboots_the_node_with_its_servers_stopped_and_started",
        ),
    ),
    Mutation(
        "reboot-cut-run-completed",
        "what a cut run stopped for a reboot stays stopped through the next run's and is started after it",
        "suites/health/reboot.py",
        "    stopped = list(dict.fromkeys([*kept, *node.units]))",
        "    stopped = list(node.units)",
        (
            "tests/health/test_health_reboot_lab.py::test_a_run_cut_between_the_stops_and_the_reboot_is_completed_by_the_next",
        ),
    ),
    Mutation(
        "reset-compute-check",
        "a reset counts only when the GPU then completes an all-reduce with right data",
        "suites/health/reset.py",
        '            ok=fine, summary=f"{len(want)} GPU(s) reset{also}; their signals',
        '            ok=True, summary=f"{len(want)} GPU(s) reset{also}; their signals',
        (
            "tests/health/test_health_reset_lab.py::test_a_reset_whose_gpu_then_fails_the_compute_check_is_not_counted",
        ),
    ),
    Mutation(
        "reset-nvlink-peers-before-ampere",
        "a GPU before Ampere is reset only with its NVLink peers in the same command (nvidia-smi(1) -r)",
        "pytest_gpuhost/modules/health/reset_set.py",
        "    if arch in BEFORE_AMPERE:",
        "    if False:",
        ("tests/health/test_health_reset_set.py",),
    ),
    Mutation(
        "reset-nvlink-peers-without-fm",
        "an Ampere GPU on NVSwitches without Fabric Manager is reset only with its NVLink peers",
        "pytest_gpuhost/modules/health/reset_set.py",
        "    if node.fabric_manager or node.nvswitch is False:",
        "    if True:",
        ("tests/health/test_health_reset_set.py",),
    ),
    Mutation(
        "reset-set-peer-holder",
        "an NVLink peer held by a process outside the inventory's services stops the set's reset",
        "suites/health/holders.py",
        "        lead.refused = list(dict.fromkeys(r for m in lead.members for r in m.refused))",
        "        lead.refused = list(dict.fromkeys(r for m in [lead] for r in m.refused))",
        ("tests/health/test_health_reset_nvlink_lab.py",),
    ),
    Mutation(
        "reset-set-no-compute-elsewhere",
        "no set reset while a process outside the inventory's services holds any other GPU",
        "suites/health/holders.py",
        "            for o in others\n            for r in o.refused\n",
        "            for o in others\n            for r in ()\n",
        ("tests/health/test_health_reset_nvlink_lab.py",),
    ),
    Mutation(
        "reset-resume-only-its-drain",
        "after a recovery the Slurm node is resumed only if this run drained it",
        "suites/health/drain.py",
        "    if hh.drained_here is None:",
        "    if False:",
        (
            "tests/nodecheck/test_nodecheck_slurm_lab.py::test_fix_reset_drains_resets_and_resumes_only_the_drain_it_made",
        ),
    ),
    Mutation(
        "reset-resume-not-a-persons-drain",
        "after a recovery a node a person drained is left drained",
        "suites/health/drain.py",
        '    if not node.ours:\n        return True, f"node drained by someone else',
        '    if False:\n        return True, f"node drained by someone else',
        (
            "tests/nodecheck/test_nodecheck_slurm_lab.py::test_fix_reset_drains_resets_and_resumes_only_the_drain_it_made",
        ),
    ),
    Mutation(
        "redact-ambiguous-shape",
        "a key-shaped value under an ambiguous name (RUNNER_TOKEN=...) is hidden",
        "pytest_gpuhost/redact.py",
        'return "remember" if _secret_shaped(v) else ""',
        'return ""',
        ("tests/report/test_redact.py",),
    ),
    Mutation(
        "scrub-authorized-keys-agent",
        "the agent's scrub never removes or rewrites an authorized_keys (the run logs in with it)",
        "pytest_gpuhost/exec/agent/probe_credentials.py",
        "    if name in PROTECTED:",
        "    if False:",
        ("tests/decommission/test_credentials.py::test_scrub_never_touches_authorized_keys",),
    ),
    Mutation(
        "scrub-authorized-keys-plan",
        "the scrub's plan never names an authorized_keys, whatever the scan's items hold",
        "pytest_gpuhost/modules/credentials.py",
        '        if i["path"].rsplit("/", 1)[-1] not in _LOGIN',
        "        if True",
        ("tests/decommission/test_credentials.py::test_scrub_items_never_name_authorized_keys",),
    ),
    Mutation(
        "scrub-only-after-safe",
        "--fix=scrub removes nothing until every step before it passed or was fixed",
        "suites/decommission/credentials.py",
        "        if refusal is not None:",
        "        if False:",
        ("tests/decommission/test_decommission_credentials_lab.py::test_scrub_waits_for_a_safe_node",),
    ),
    Mutation(
        "accept-check-only-writes-nothing",
        "suites/accept under --check-only writes no scratch file on the node",
        "suites/accept/steps.py",
        "        write = o.write_mb_s is not None and not proc.check_only",
        "        write = o.write_mb_s is not None",
        ("tests/accept/test_accept_lab.py::test_check_only_writes_nothing_on_the_node",),
    ),
    Mutation(
        "accept-scratch-removed",
        "the data volume's scratch file is removed after its measurement",
        "suites/accept/disk.py",
        "        os.unlink(name)",
        "        pass",
        (
            "tests/accept/test_accept_lab.py::test_a_really_slow_data_volume_is_rejected_naming_the_throughput",
        ),
    ),
    Mutation(
        "decommission-room-preflight",
        "step 1 refuses a backup directory without room for the node's bytes, before the first stop",
        "suites/decommission/preflight.py",
        "    if needed * (1 + margin) > free:",
        "    if False:",
        (
            "tests/decommission/test_decommission_preflight.py::"
            "test_room_at_the_backup_dir_is_the_bytes_to_copy_against_its_filesystems_free_space",
        ),
    ),
    Mutation(
        "decommission-owner-record-deferred",
        "the destinations' owner records wait until step 1's preflight passed: a refused run leaves none",
        "suites/decommission/node.py",
        "        self._stake = (me, None if local.exists() else local, client, s3_key)",
        "        self._stake = (me, None if local.exists() else local, client, s3_key)\n        self.stake()",
        (ROOM_TEST,),
    ),
    Mutation(
        "decommission-timeline-deferred",
        "a timeline line before step 1's preflight passed waits in memory: a refused run writes none",
        "suites/decommission/node.py",
        "        if self.check_only or self._stake is not None:",
        "        if self.check_only:",
        (ROOM_TEST,),
    ),
    Mutation(
        "decommission-check-only-meta",
        "--check-only makes no .gpuhost folder in the backup directory",
        "suites/decommission/node.py",
        "        if not self.check_only:\n            path.mkdir(parents=True, exist_ok=True)",
        "        if True:\n            path.mkdir(parents=True, exist_ok=True)",
        (CHECK_ONLY_TEST + "test_decommission_check_only_leaves_node_backup_dir_and_buckets_as_they_were",),
    ),
    Mutation(
        "health-check-only-controller-state",
        "a --check-only health run keeps its kernel-log cursor on the controller, never on the node",
        "suites/health/conftest.py",
        "                if self.check_only:  # writes nothing on the node: the controller keeps it",
        "                if False:",
        (CHECK_ONLY_TEST + "test_health_check_only_leaves_host_as_it_was_and_remembers_on_the_controller",),
    ),
)


def _copy(work: Path) -> None:
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, work / name)


def _pytest(
    work: Path, python: str, tests: Sequence[str], *, stop_first: bool
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [
            python,
            "-m",
            "pytest",
            *(["-x"] if stop_first else []),
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            *tests,
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def guarding_tests(chosen: Sequence[Mutation]) -> list[str]:
    """Every guarding test of ``chosen`` once; a node id inside a whole file that is listed is dropped."""
    ids = sorted({t for m in chosen for t in m.tests})
    files = {t for t in ids if "::" not in t}
    return [t for t in ids if t in files or t.split("::", 1)[0] not in files]


def expected_cost(m: Mutation) -> int:
    """Rank a mutant by what its guarding tests cost: a lab host to boot, a whole file, one test."""
    return max(2 if "_lab" in t or "realkernel" in t else 1 if "::" not in t else 0 for t in m.tests)


def run_control(chosen: Sequence[Mutation], python: str) -> tuple[str, float]:
    """Run every guarding test once, in one session of an unmutated copy: ("passed"|"failed: ...", seconds).

    A kill proves something only if the same tests pass without the mutation. One session for all
    of them boots each lab host once, where a control per mutation booted it once per mutation.
    """
    with tempfile.TemporaryDirectory(prefix="gpuhost-control-") as tmp:
        work = Path(tmp)
        _copy(work)
        t0 = time.monotonic()
        r = _pytest(work, python, guarding_tests(chosen), stop_first=False)
        took = time.monotonic() - t0
    if r.returncode == 0:
        return "passed", took
    failed = [line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    tail = failed or (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    return f"failed: pytest exit {r.returncode}: " + "; ".join(x[:200] for x in tail), took


def run_one(m: Mutation, python: str) -> tuple[str, float]:
    """Return ("killed"|"survived"|"error: ...", seconds) for the guarding tests of the mutated copy."""
    with tempfile.TemporaryDirectory(prefix="gpuhost-mutant-") as tmp:
        work = Path(tmp)
        _copy(work)
        target = work / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            return f"error: {m.path} holds {text.count(m.old)} copies of the line to change", 0.0
        target.write_text(text.replace(m.old, m.new))
        t0 = time.monotonic()
        r = _pytest(work, python, m.tests, stop_first=True)
        took = time.monotonic() - t0
        if r.returncode == 1:
            by = next(
                (ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))), ""
            )
            return f"killed by {by}" if by else "killed", took
        if r.returncode == 0:
            return "survived", took
        tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
        return f"error: pytest exit {r.returncode}: {tail[0][:200]}", took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--guards", action="store_true", help="print the guarding tests, one per line, and exit")
    ap.add_argument(
        "--no-control",
        action="store_true",
        help="skip the unmutated run: the caller runs the guarding tests itself (the full suite)",
    )
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mutations run at once")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"mutate: unknown mutation(s) {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.why} ({m.path})")
        return 0
    if args.guards:
        print("\n".join(guarding_tests(chosen)))
        return 0

    def one(m: Mutation) -> tuple[bool, str]:
        verdict, took = run_one(m, sys.executable)
        killed = verdict.startswith("killed")
        return killed, f"{m.name:24} {verdict.split()[0]:10} {took:5.1f} s  {m.why}" + (
            f"\n{'':24} {verdict}" if killed and verdict != "killed" else ""
        )

    # each mutation runs in a copy of its own, so they can run side by side (one per core); the
    # control (the guarding tests, unmutated, in one session) runs beside them and is judged at the end
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        control_job = None if args.no_control else pool.submit(run_control, chosen, sys.executable)
        # the longest first (a lab boot, then a whole file): a long mutant started last would run
        # on alone while the other worker sits idle
        jobs = {m.name: pool.submit(one, m) for m in sorted(chosen, key=expected_cost, reverse=True)}
        results = [jobs[m.name].result() for m in chosen]
        control, took = control_job.result() if control_job else ("passed", 0.0)
    if control_job:
        print(f"{'control':24} {control.split(':')[0]:10} {took:5.1f} s  the guarding tests pass unmutated")
    else:
        print(f"{'control':24} {'left':10}         the caller runs the guarding tests unmutated")
    bad = 0
    for ok, line in results:
        bad += not ok
        print(line)
    if control != "passed":
        print(f"mutate: the guarding tests fail without any mutation ({control}), so no kill proves anything")
        return 1
    print(f"mutate: {len(chosen) - bad} of {len(chosen)} mutations killed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
