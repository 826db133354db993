"""Running untrusted Python (a model's code answer) so that it cannot hurt the run.

Every run gets a fresh temporary directory as its working directory, stdin/stdout in files there
(a program that prints gigabytes fills its file-size limit, not our memory), resource limits set
in the child before the program starts (CPU seconds, address space, file size, open files,
processes), a wall-clock timeout after which its whole process group is killed, and Python's
isolated mode (`-I`: no PYTHON* variables, no user site, neither the script's nor the current
directory on sys.path) with an environment that holds no proxies or tokens.

Every level also installs a seccomp filter in the child before the program starts: fork, vfork and
clone without CLONE_THREAD fail (EAGAIN), clone3 fails with ENOSYS so libc falls back to clone;
threads still work. It is kernel-enforced, so native code (ctypes, C extensions) cannot start
processes either; fork(), the subprocess module and friends are also refused at the Python level
(a clear error, and a fallback on architectures the filter does not know).

Isolation levels (`isolation()` says which this machine gets; probed once per process):
  "namespaces"  Linux user + mount + network + pid namespaces (`unshare`): no network at all (an
                empty network namespace), the whole filesystem read-only except the run's own
                directory, the project's directory and /dev/shm hidden under empty tmpfs mounts,
                and every process dies with the first one (the pid namespace ends with it). The
                mapped user is our own; where that is root the kernel does not enforce the
                process-count limit, which is why the seccomp filter matters.
  "rlimits"     no namespaces available: the same limits, seccomp filter and Python-level
                refusals, but the program could read files our user can read, and native code
                could reach the network.
Neither level defends the reward against a policy that inspects its own harness (e.g. reads the
pass marker of an assert test): it contains damage, it is not an anti-cheat.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_s: float = 10.0
  cpu_s: int = 5
  memory_mb: int = 1024  # address space
  file_mb: int = 16  # any file it writes, its stdout included
  processes: int = 16
  open_files: int = 64


@dataclasses.dataclass(frozen=True)
class RunResult:
  returncode: int | None  # None when the wall timeout killed it
  stdout: str
  timed_out: bool


# Runs inside the sandbox before the program: limits, then the Python-level refusals, then the
# program as __main__. argv: limits (cpu, memory, file, processes, files) and the program's path.
_PRELUDE = r"""
import os, resource, runpy, sys
cpu, mem, fsize, nproc, nofile = map(int, sys.argv[1:6])
for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE,
    fsize), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, nofile),
    (resource.RLIMIT_CORE, 0)):
  resource.setrlimit(res, (value, value))
def _no_new_processes():
  # A seccomp filter (kernel-enforced, also against native code): fork, vfork and clone without
  # CLONE_THREAD fail with EAGAIN, clone3 with ENOSYS (libc falls back to clone); threads work.
  import ctypes, platform, struct
  arch, nrs = {"x86_64": (0xC000003E, (435, 57, 58, 56)),
               "aarch64": (0xC00000B7, (435, 0xFFFFFFFF, 0xFFFFFFFF, 220))}[platform.machine()]
  clone3, fork, vfork, clone = nrs
  allow, eagain, enosys = 0x7FFF0000, 0x00050000 | 11, 0x00050000 | 38
  ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
  prog = [(ld, 0, 0, 4), (jeq, 0, 7, arch), (ld, 0, 0, 0), (jeq, 7, 0, clone3), (jeq, 5, 0, fork),
          (jeq, 4, 0, vfork), (jeq, 0, 2, clone), (ld, 0, 0, 16), (jset, 0, 1, 0x10000),
          (ret, 0, 0, allow), (ret, 0, 0, eagain), (ret, 0, 0, enosys)]
  raw = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
  fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(raw))
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0):
    raise OSError(ctypes.get_errno(), "seccomp")
try:
  _no_new_processes()
  seccomp = True
except Exception:
  seccomp = False
def _refused(*args, **kwargs):
  raise PermissionError("not allowed in the reward sandbox")
import socket, subprocess
socket.socket = socket.create_connection = socket.socketpair = _refused
for name in ("fork", "forkpty", "vfork", "system", "popen", "posix_spawn", "posix_spawnp",
             "execv", "execve", "execvp", "execvpe", "execl", "execlp", "spawnv", "spawnve"):
  if hasattr(os, name):
    setattr(os, name, _refused)
subprocess.Popen = _refused
path = sys.argv[6]
sys.argv = [path]
del cpu, mem, fsize, nproc, nofile, res, value, name, seccomp, _no_new_processes
runpy.run_path(path, run_name="__main__")
"""

# Inside the namespaces, as the mapped root: the run's directory stays writable (its own bind
# mount, kept by the recursive bind below), everything else is remounted read-only, the project
# and /dev/shm are covered by empty tmpfs mounts, then the program runs in its directory.
_NAMESPACE_SETUP = r"""
set -e
W=$1; FLAGS=$2; shift 2
mount --bind "$W" "$W"
mount --rbind / /
mount -o "remount,bind,$FLAGS" /
for d in $HIDE; do mount -t tmpfs -o size=1m,mode=755 tmpfs "$d"; done
cd "$W"
exec "$@"
"""


def _root_mount_flags() -> str:
  """The options a read-only remount of / must keep (a user namespace may not drop the locked
  ones: relatime, nosuid, nodev, noexec)."""
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      if fields[4] == "/":
        opts = [o for o in fields[5].split(",") if o != "rw"]
        return ",".join(["ro", *opts])
  return "ro"


def _hidden_paths() -> list[str]:
  """The project's directory, unless the interpreter lives inside it (a venv in the checkout)."""
  prefix = os.path.realpath(sys.prefix)
  paths = []
  for path in {os.path.realpath(PROJECT_ROOT), "/dev/shm"}:
    if os.path.isdir(path) and not (prefix + os.sep).startswith(path + os.sep):
      paths.append(path)
  return sorted(paths)


def _command(workdir: str, program: str, limits: Limits, namespaces: bool) -> list[str]:
  python = [sys.executable, "-I", "-c", _PRELUDE, str(limits.cpu_s), str(limits.memory_mb << 20),
            str(limits.file_mb << 20), str(limits.processes), str(limits.open_files), program]
  if not namespaces:
    return python
  return ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
          "--kill-child", "sh", "-c", _NAMESPACE_SETUP, "sh", workdir, _root_mount_flags(),
          *python]


def _env() -> dict[str, str]:
  return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
          "HIDE": " ".join(_hidden_paths())}


def _run(source: str, stdin: str, limits: Limits, namespaces: bool) -> RunResult:
  workdir = tempfile.mkdtemp(prefix="tlt_sandbox_")
  try:
    program = os.path.join(workdir, "solution.py")
    with open(program, "w", encoding="utf-8") as f:
      f.write(source)
    stdin_path, stdout_path = os.path.join(workdir, ".stdin"), os.path.join(workdir, ".stdout")
    with open(stdin_path, "w", encoding="utf-8") as f:
      f.write(stdin)
    with open(stdin_path, "rb") as fin, open(stdout_path, "wb") as fout:
      proc = subprocess.Popen(_command(workdir, program, limits, namespaces), stdin=fin,
                              stdout=fout, stderr=subprocess.DEVNULL, cwd=workdir, env=_env(),
                              start_new_session=True)
      timed_out = False
      try:
        proc.wait(timeout=limits.wall_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        try:  # the whole group, also after a normal exit (a child left behind)
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        proc.wait()
    with open(stdout_path, "rb") as f:
      stdout = f.read(limits.file_mb << 20).decode("utf-8", errors="replace")
    return RunResult(None if timed_out else proc.returncode, stdout, timed_out)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


@functools.cache
def isolation() -> str:
  """'namespaces' when a namespace sandbox works here (probed once), else 'rlimits'."""
  if sys.platform != "linux" or shutil.which("unshare") is None:
    return "rlimits"
  probe = ("import os, socket\n"
           f"assert not os.path.exists({os.path.join(PROJECT_ROOT, 'tlt_jax')!r})\n"
           "print('ok')\n")
  try:
    result = _run(probe, "", Limits(wall_s=20), namespaces=True)
  except OSError:
    return "rlimits"
  return "namespaces" if result.stdout.strip() == "ok" else "rlimits"


def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
  """Runs `source` as a Python program in the sandbox with `stdin`; its stdout and exit code."""
  return _run(source, stdin, limits, namespaces=isolation() == "namespaces")

