"""Stand-in for ``cupy.cuda.runtime`` (device count from LBANNPY_STANDIN_DEVICES, default 4)."""
from cupy import _standin


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():
    return _standin.device_count()


def getDevice():
    return _standin.local.device


def setDevice(device):
    from cupy.cuda import Device
    Device(device).use()


def deviceSynchronize():
    from cupy.cuda import Device
    Device().synchronize()


def memGetInfo():
    total = 80 << 30
    used = sum(a.nbytes for a in list(_standin._allocs.values()) if a.device == _standin.local.device)
    return (total - used, total)


def runtimeGetVersion():
    return 12040
