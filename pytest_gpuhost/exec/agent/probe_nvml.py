"""Agent probe library: NVML through ctypes, each read in a forked child under a deadline.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py); registers no op
or fact: probe_health_nvml.py reads the health checks' GPU facts with it.  Loads
libnvidia-ml.so.1 with ctypes as pynvml does (CDLL, argtypes/restype, the versioned symbols).
A read runs in a forked child (`bounded`): a driver call that never returns is killed with the
child at the deadline, and the answer says which call hung and after how long; the agent itself
never loads the library.  Signatures, structures and constants: NVIDIA's nvml.h, as vendored by
NVIDIA/go-nvml, https://github.com/NVIDIA/go-nvml/blob/main/gen/nvml/nvml.h (line numbers at
commit 2f9e261).
"""

import ctypes
import json
import os
import select
import signal
import time

LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3  # nvml.h:1301
NVML_ERROR_INSUFFICIENT_SIZE = 7  # nvml.h:1305
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25  # nvml.h:1323
BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE, NVML_DEVICE_UUID_V2_BUFFER_SIZE (nvml.h:4080, 4105)
DRIVER_BUFFER = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE (nvml.h:4090)
VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by nvmlValueType_t


class PciInfo(ctypes.Structure):
    """nvmlPciInfo_t (nvml.h:196-208): 68 bytes."""

    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),  # NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),  # NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
    ]


class Value(ctypes.Union):
    """nvmlValue_t (nvml.h:665-674)."""

    _fields_ = [
        ("dVal", ctypes.c_double),
        ("siVal", ctypes.c_int),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("usVal", ctypes.c_ushort),
    ]


class FieldValue(ctypes.Structure):
    """nvmlFieldValue_t (nvml.h:3010-3019): 40 bytes on LP64."""

    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", Value),
    ]


class FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t (nvml.h:3813-3819): 28 bytes; the deprecated call's structure."""

    _fields_ = [
        ("clusterUuid", ctypes.c_ubyte * 16),  # NVML_GPU_FABRIC_UUID_LEN
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
    ]


class FabricInfoV2(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t (nvml.h:3924-3932): 36 bytes, `version` set before the call."""

    _fields_ = [("version", ctypes.c_uint)] + FabricInfo._fields_ + [("healthMask", ctypes.c_uint)]


# NVML_STRUCT_VERSION(GpuFabricInfo, 2) (nvml.h:141, 3937): the size, and the version in the top byte
FABRIC_V2 = ctypes.sizeof(FabricInfoV2) | (2 << 24)

_P = ctypes.POINTER
Handle = ctypes.c_void_p  # nvmlDevice_t, an opaque pointer
# name -> argtypes, each with restype nvmlReturn_t (an int); nvml.h's line of the declaration
SIGNATURES = {
    "nvmlInit_v2": [],  # 4002
    "nvmlShutdown": [],  # 4031
    "nvmlSystemGetDriverVersion": [ctypes.c_char_p, ctypes.c_uint],  # 4194
    "nvmlDeviceGetCount_v2": [_P(ctypes.c_uint)],  # 4573
    "nvmlDeviceGetHandleByIndex_v2": [ctypes.c_uint, _P(Handle)],  # 4641
    "nvmlDeviceGetName": [Handle, ctypes.c_char_p, ctypes.c_uint],  # 4784
    "nvmlDeviceGetUUID": [Handle, ctypes.c_char_p, ctypes.c_uint],  # 5186
    "nvmlDeviceGetPciInfo_v3": [Handle, _P(PciInfo)],  # 5471
    "nvmlDeviceGetPersistenceMode": [Handle, _P(ctypes.c_uint)],  # 5433
    "nvmlDeviceGetTemperature": [Handle, ctypes.c_int, _P(ctypes.c_uint)],  # 5958
    "nvmlDeviceGetTemperatureThreshold": [Handle, ctypes.c_int, _P(ctypes.c_uint)],  # 6044
    "nvmlDeviceGetEccMode": [Handle, _P(ctypes.c_uint), _P(ctypes.c_uint)],  # 6886
    "nvmlDeviceGetTotalEccErrors": [Handle, ctypes.c_int, ctypes.c_int, _P(ctypes.c_ulonglong)],  # 6986
    "nvmlDeviceGetRetiredPagesPendingStatus": [Handle, _P(ctypes.c_uint)],  # 8407
    "nvmlDeviceGetRemappedRows": [Handle] + [_P(ctypes.c_uint)] * 4,  # 8434
    "nvmlDeviceGetCurrentClocksEventReasons": [Handle, _P(ctypes.c_ulonglong)],  # 6121
    "nvmlDeviceGetCurrPcieLinkGeneration": [Handle, _P(ctypes.c_uint)],  # 5549
    # nvmlPstates_t is an enum: an int-sized value (0..15, 32 unknown)
    "nvmlDeviceGetPerformanceState": [Handle, _P(ctypes.c_uint)],
    "nvmlDeviceGetMaxPcieLinkGeneration": [Handle, _P(ctypes.c_uint)],  # 5492
    "nvmlDeviceGetCurrPcieLinkWidth": [Handle, _P(ctypes.c_uint)],  # 5567
    "nvmlDeviceGetMaxPcieLinkWidth": [Handle, _P(ctypes.c_uint)],  # 5531
    "nvmlDeviceGetFieldValues": [Handle, ctypes.c_int, _P(FieldValue)],  # 10230
    "nvmlDeviceGetMigMode": [Handle, _P(ctypes.c_uint), _P(ctypes.c_uint)],  # 12803
    "nvmlDeviceGetNvLinkState": [Handle, ctypes.c_uint, _P(ctypes.c_uint)],  # 9506
    "nvmlDeviceGetNvLinkErrorCounter": [Handle, ctypes.c_uint, ctypes.c_int, _P(ctypes.c_ulonglong)],  # 9585
    "nvmlDeviceGetGpuFabricInfoV": [Handle, _P(FabricInfoV2)],  # 7852
    "nvmlDeviceGetGpuFabricInfo": [Handle, _P(FabricInfo)],  # 7829, deprecated for the V call
}
# Drivers before R535 have the older name of the clock-event call (nvml.h keeps it as deprecated).
FALLBACK_SYMBOL = {"nvmlDeviceGetCurrentClocksEventReasons": "nvmlDeviceGetCurrentClocksThrottleReasons"}


class Nvml:
    """The library's calls, each announced to `progress(name)` before it is made."""

    def __init__(self, path, progress):
        self.lib = ctypes.CDLL(path)
        self.progress = progress
        self.calls = 0
        self.lib.nvmlErrorString.restype = ctypes.c_char_p  # nvml.h:4057
        self.lib.nvmlErrorString.argtypes = [ctypes.c_int]
        self.fns = {}  # type: dict

    def fn(self, name):
        if name not in self.fns:
            try:
                f = getattr(self.lib, name)
            except AttributeError:
                f = getattr(self.lib, FALLBACK_SYMBOL.get(name, name))
            f.argtypes = SIGNATURES[name]
            f.restype = ctypes.c_int
            self.fns[name] = f
        return self.fns[name]

    def has(self, name):
        try:
            self.fn(name)
        except AttributeError:
            return False
        return True

    def call(self, name, *args):
        """Make one call; return its nvmlReturn_t (an absent symbol is NOT_SUPPORTED)."""
        try:
            f = self.fn(name)
        except AttributeError:
            return NVML_ERROR_NOT_SUPPORTED
        self.progress(name)
        self.calls += 1
        return int(f(*args))

    def error(self, rc):
        return (self.lib.nvmlErrorString(rc) or b"Unknown Error").decode("utf-8", "replace")


def text(nv, name, *args):
    buf = ctypes.create_string_buffer(BUFFER)
    rc = nv.call(name, *(args + (buf, BUFFER)))
    return rc, buf.value.decode("utf-8", "replace")


def read_fields(nv, h, ids):
    """Return {field id: (nvmlReturn_t, value)} from one nvmlDeviceGetFieldValues call.

    An id may be a (field id, scope id) pair (the link, for NVLink fields): its key is the pair.
    """
    values = (FieldValue * len(ids))()
    for i, fid in enumerate(ids):
        values[i].fieldId, values[i].scopeId = fid if isinstance(fid, tuple) else (fid, 0)
    rc = nv.call("nvmlDeviceGetFieldValues", h, len(ids), values)
    out = {}
    for i, fid in enumerate(ids):
        if rc != NVML_SUCCESS:
            out[fid] = (rc, None)
            continue
        fv = values[i]
        kind = VALUE_FIELDS[fv.valueType] if 0 <= fv.valueType < len(VALUE_FIELDS) else "ullVal"
        out[fid] = (fv.nvmlReturn, getattr(fv.value, kind) if fv.nvmlReturn == NVML_SUCCESS else None)
    return out


def _child(path, read, wfd):
    def progress(name):
        os.write(wfd, ("C " + name + "\n").encode("ascii"))

    try:
        out = read(Nvml(path, progress))
    except OSError as exc:  # no library: CDLL's dlopen message
        out = {"ok": False, "absent": True, "error": " ".join(str(exc).split())}
    except Exception as exc:
        out = {"ok": False, "error": "{}: {}".format(type(exc).__name__, " ".join(str(exc).split()))}
    os.write(wfd, ("R " + json.dumps(out) + "\n").encode("utf-8"))


def bounded(path, read, timeout):
    """Run `read(Nvml)` in a forked child; kill it at `timeout` and say which call it was in.

    `read` returns a JSON-able dict; a library that cannot be loaded is `{"absent": True}`.
    """
    rfd, wfd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the agent
        code = 0
        try:
            os.close(rfd)
            _detach(wfd)
            _child(path, read, wfd)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(wfd)
    data = b""
    deadline = started + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([rfd], [], [], left)
            if not ready:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(rfd)
    lines = data.decode("utf-8", "replace").splitlines()
    done = [ln[2:] for ln in lines if ln.startswith("R ")]
    calls = [ln[2:] for ln in lines if ln.startswith("C ")]
    took = round(time.monotonic() - started, 3)
    if not done:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap(pid)
    if done:
        out = json.loads(done[-1])
        out["duration"] = took
        return out
    if not calls:
        return {"ok": False, "error": "NVML child exited without an answer", "duration": took}
    return {
        "ok": False,
        "error": "driver hung",
        "call": calls[-1],
        "after_s": float(timeout),
        "calls": len(calls),
        "duration": took,
    }


def _detach(keep):
    """Leave the agent's descriptors (the protocol's among them) to the agent alone.

    A child stuck in the driver outlives the agent; holding the SSH channel open it would keep
    the session from closing. stdin, stdout and stderr become /dev/null (the library may print).
    """
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != keep:
            os.dup2(null, fd)
    for fd in range(3, 4096):
        if fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _reap(pid):
    # A child stuck in the kernel (uninterruptible in the driver) dies only when the call ends:
    # wait a little, then leave it; the agent's exit hands it to init.
    deadline = time.monotonic() + 1.0
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.005)
