"""Hold Linux's CPU latency request (/dev/cpu_dma_latency, PM QoS) at 0 us until killed: CPUs
stay out of idle states that take long to leave. Prints the machine's cpuidle driver, governor and
states first (what the request acts on). python3 scripts/gpu/hold_pmqos.py"""

import glob
import signal
import struct
import sys
from pathlib import Path


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({exc.strerror})"


print(
    "cpuidle:",
    read("/sys/devices/system/cpu/cpuidle/current_driver"),
    read("/sys/devices/system/cpu/cpuidle/current_governor"),
    flush=True,
)
for state in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
    print(" ", read(f"{state}/name"), "latency us", read(f"{state}/latency"), flush=True)
try:
    fd = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115 (held open: closing drops it)
    fd.write(struct.pack("i", 0))
except OSError as exc:
    print("cannot hold /dev/cpu_dma_latency:", exc, file=sys.stderr, flush=True)
    sys.exit(1)
print("holding /dev/cpu_dma_latency at 0", flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
