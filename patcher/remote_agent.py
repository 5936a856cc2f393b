# ruff: noqa: UP031, UP022, SIM105
"""The remote half of dynspec-patch: a stdlib-only program shipped over SSH and run on the host.

``patcher.ssh`` sends this file's source to the host's own ``python3`` (under ``sudo -n`` when
the login is not root), so it must not import anything outside the standard library and must
run on Python 3.8+. It speaks newline-delimited JSON on stdin/stdout: one request, zero or more
``{"progress": ...}`` lines, then one ``{"ok": ...}`` answer.

Why an agent and not one shell command per step:
- the ``flock`` on ``<state>/lock`` is held by this process for the whole command, and released
  by the kernel the moment the process dies (connection lost, Ctrl-C): no stale locks;
- every step is one request, so ``apply --no-restart`` is three round trips;
- a request that has started runs to its end even if the SSH connection drops (answers to a
  closed pipe are dropped), so a restart that fails still rolls itself back on the host.

Nothing here decides *what* to patch: the bytes to write arrive from the planning engine.
"""

import base64
import errno
import fcntl
import getpass
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib

AGENT_PROTOCOL = 1
STATE_DIRNAME = ".dynspec-patch"
LAUNCH_MODULES = ("sglang.launch_server",)
# a container's init (docker run --init, tini) carries the server's argv after its own
INIT_WRAPPERS = ("docker-init", "tini", "tini-static", "dumb-init")
# how ssh.py starts this agent; the agent starts itself the same way inside a container
BOOTSTRAP = (
    "import base64,sys,zlib;"
    "exec(compile(zlib.decompress(base64.b64decode(sys.argv[1])),'dynspec-agent','exec'),"
    "{'__name__':'__main__'})"
)
PROC = os.environ.get("DYNSPEC_PROC", "/proc")

STAGE_NAME = ".%s.dynspec-stage.tmp"

_lock_fd = None
_out = sys.stdout
_staged = []  # temp files written by stage and not yet renamed: removed if the client leaves


class Refused(Exception):
    kind = "refused"


class Busy(Exception):
    kind = "busy"


def emit(obj):
    global _out
    if _out is None:
        return
    try:
        _out.write(json.dumps(obj) + "\n")
        _out.flush()
    except (BrokenPipeError, OSError, ValueError):
        _out = None  # the client is gone; finish the request anyway


def progress(msg):
    emit({"progress": msg})


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    try:
        with open(path, "rb") as fh:
            return sha256_bytes(fh.read())
    except FileNotFoundError:
        return None


def read_bytes(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def b64(data):
    return None if data is None else base64.b64encode(data).decode("ascii")


def unb64(text):
    return None if text is None else base64.b64decode(text)


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, data, like=None, mode=0o644):
    """Write ``data`` to ``path`` via a temp file beside it and ``rename``."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, ".%s.dynspec-%d.tmp" % (os.path.basename(path), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if like and os.path.exists(like):
        copy_owner_mode(like, tmp)
    os.rename(tmp, path)
    fsync_dir(directory)


def copy_owner_mode(src, dst):
    st = os.stat(src)
    os.chmod(dst, st.st_mode & 0o7777)
    if os.geteuid() == 0:
        os.chown(dst, st.st_uid, st.st_gid)


# --------------------------------------------------------------------------- processes


def _read_proc(pid, name):
    """``/proc/PID/<name>``, or None once the process is gone: a process listed a moment ago
    may exit before it is read (``open`` then fails with ENOENT, a read of the open file with
    ESRCH), and one of another user may be unreadable (``hidepid``, a set-uid exec)."""
    try:
        with open(os.path.join(PROC, str(pid), name), "rb") as fh:
            return fh.read()
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError, PermissionError):
        return None


def proc_stat(pid):
    raw = _read_proc(pid, "stat")
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace")
    rest = text[text.rfind(")") + 2 :].split()
    return {
        "state": rest[0],
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "sid": int(rest[3]),
        "starttime": int(rest[19]),
    }


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st["state"] not in ("Z", "X")


def all_pids():
    out = []
    for name in os.listdir(PROC):
        if name.isdigit():
            out.append(int(name))
    return out


def argv_of(pid):
    raw = _read_proc(pid, "cmdline")
    if not raw:
        return None
    return [p.decode("utf-8", "surrogateescape") for p in raw.rstrip(b"\0").split(b"\0")]


def environ_of(pid):
    try:
        with open(os.path.join(PROC, str(pid), "environ"), "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        return None, "cannot read /proc/%d/environ: %s" % (pid, exc.strerror)
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
    return env, None


def readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def is_server_argv(argv):
    """True for ``python -m sglang.launch_server ...`` and ``sglang serve ...``."""
    if not argv or os.path.basename(argv[0]) in INIT_WRAPPERS:
        return False
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in LAUNCH_MODULES:
            return True
        if arg.startswith("-m") and arg[2:] in LAUNCH_MODULES:
            return True
        base = os.path.basename(arg)
        if base == "sglang" and i + 1 < len(argv) and argv[i + 1] == "serve" and i <= 1:
            return True
        if arg.endswith("sglang/launch_server.py") and i <= 1:
            return True
    return False


def flag_value(argv, name):
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def listening_inodes():
    """Map socket inode -> port for TCP sockets in LISTEN state."""
    out = {}
    for name in ("tcp", "tcp6"):
        raw = read_bytes(os.path.join(PROC, "net", name))
        if not raw:
            continue
        for line in raw.decode().splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A":
                out[parts[9]] = int(parts[1].rsplit(":", 1)[1], 16)
    return out


def listening_ports():
    return sorted(set(listening_inodes().values()))


def descendants(root):
    children = {}
    for pid in all_pids():
        st = proc_stat(pid)
        if st:
            children.setdefault(st["ppid"], []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def ports_of(pids):
    inodes = listening_inodes()
    ports = set()
    for pid in pids:
        fd_dir = os.path.join(PROC, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            target = readlink(os.path.join(fd_dir, fd)) or ""
            if target.startswith("socket:["):
                inode = target[8:-1]
                if inode in inodes:
                    ports.add(inodes[inode])
    return sorted(ports)


def status_field(pid, name):
    raw = _read_proc(pid, "status")
    if raw:
        for line in raw.decode("utf-8", "replace").splitlines():
            if line.startswith(name + ":"):
                return line.split()[1]
    return None


def uid_of(pid):
    value = status_field(pid, "Uid")
    return int(value) if value is not None else None


def find_servers():
    me = os.getpid()
    matches = {}
    for pid in all_pids():
        if pid == me:
            continue
        argv = argv_of(pid)
        st = proc_stat(pid)
        if not argv or not st or st["state"] in ("Z", "X") or not is_server_argv(argv):
            continue
        matches[pid] = (argv, st)
    servers = []
    for pid, (argv, st) in sorted(matches.items()):
        if st["ppid"] in matches:
            continue  # a forked child of a server we already list
        uid = uid_of(pid)
        try:
            user = pwd.getpwuid(uid).pw_name if uid is not None else None
        except KeyError:
            user = None
        env, env_error = environ_of(pid)
        tree = [pid, *descendants(pid)]
        ports = ports_of(tree)
        port_flag = flag_value(argv, "--port")
        stdout = readlink(os.path.join(PROC, str(pid), "fd", "1"))
        gid = status_field(pid, "Gid")
        sig_ign = status_field(pid, "SigIgn")
        container_id = container_id_of(pid)
        if not alive(pid):
            continue  # it exited while it was read: what was read of it is incomplete
        servers.append(
            {
                "pid": pid,
                "ppid": st["ppid"],
                "pgid": st["pgid"],
                "sid": st["sid"],
                "uid": uid,
                "user": user,
                "argv": argv,
                "env": env,
                "env_error": env_error,
                "cwd": readlink(os.path.join(PROC, str(pid), "cwd")),
                "exe": readlink(os.path.join(PROC, str(pid), "exe")),
                "listening": ports,
                "port": int(port_flag) if port_flag and port_flag.isdigit() else None,
                "host": flag_value(argv, "--host"),
                "address": connect_host({"host": flag_value(argv, "--host")}),
                "stdout": stdout if stdout and stdout.startswith("/") else None,
                "tree": tree,
                "gid": int(gid or -1),
                "sig_ign": sig_ign,
                "container_id": container_id,
            }
        )
    return servers


def server_port(server):
    if server.get("port"):
        return server["port"]
    if server.get("listening"):
        return server["listening"][0]
    return 30000


def connect_host(server):
    """The address the server is reached at on the host: the one it listens on (``--host``),
    loopback where it listens on every address (``0.0.0.0``; ``::`` is IPv6 only there)."""
    host = server.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "", "localhost"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


# --------------------------------------------------------------------------- HTTP on the host


def http_get(host, port, path, api_key=None, timeout=5.0, data=None):
    url = "http://%s:%d%s" % ("[%s]" % host if ":" in host else host, port, path)
    req = urllib.request.Request(url, data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", "Bearer " + api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError) as exc:
        return None, str(exc).encode()


def server_info(server):
    host, port = connect_host(server), server_port(server)
    api_key = flag_value(server["argv"], "--api-key")
    tried = []
    for path in ("/server_info", "/get_server_info"):
        status, body = http_get(host, port, path, api_key)
        tried.append({"endpoint": path, "status": status})
        if status == 200:
            try:
                return {"endpoint": path, "body": json.loads(body.decode()), "tried": tried}
            except ValueError:
                tried[-1]["error"] = "not JSON"
        else:
            tried[-1]["error"] = body[:200].decode("utf-8", "replace")
    return {"endpoint": None, "body": None, "tried": tried}


def server_args_log_line(path, limit=8 << 20):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return None
    found = None
    for line in data.decode("utf-8", "replace").splitlines():
        idx = line.find("server_args=")
        if idx >= 0:
            found = line[idx:]
    return found


# --------------------------------------------------------------------------- package discovery

FIND_SPEC = (
    "import importlib.util, json, sys\n"
    "s = importlib.util.find_spec('sglang')\n"
    "locs = list(s.submodule_search_locations or []) if s else []\n"
    "print(json.dumps({'origin': s.origin if s else None, 'locations': locs,"
    " 'executable': sys.executable, 'version': list(sys.version_info[:3])}))\n"
)


def interpreter(python):
    """``(argv0, executable)``: a venv python is recognised by its argv[0], while /proc/PID/exe
    is the resolved base interpreter, so both are needed to run "the server's python"."""
    exe = python.get("exe")
    if not exe or exe.endswith(" (deleted)") or not os.path.exists(exe):
        exe = None
    return python.get("argv0") or exe, exe


def find_package(python, env=None, cwd=None, uid=None):
    """Locate the sglang package the way ``python`` would, without importing it (as the
    server's own user: its environment may run code, e.g. a sitecustomize)."""
    argv0, exe = interpreter(python)
    try:
        proc = subprocess.run(
            [argv0, "-c", FIND_SPEC], executable=exe, env=env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None, preexec_fn=demote(uid, None),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, "cannot run %s: %s" % (argv0, exc)
    if proc.returncode != 0:
        return None, "%s failed: %s" % (argv0, proc.stderr.decode("utf-8", "replace")[-300:])
    try:
        info = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, "unexpected output from %s" % argv0
    for loc in info["locations"]:
        if os.path.isfile(os.path.join(loc, "__init__.py")):
            info["package_dir"] = loc
            return info, None
    return None, "sglang is not importable by %s" % argv0


VERSION_RE = re.compile(
    r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:\w+\s*=\s*)?['"]([^'"]+)['"]""", re.M
)


def release_of(pkg):
    for name in ("_version.py", "version.py"):
        text = read_bytes(os.path.join(pkg, name))
        if text:
            m = VERSION_RE.search(text.decode("utf-8", "replace"))
            if m:
                return m.group(1), name
    return None, None


# --------------------------------------------------------------------------- state directory


def state_dir_for(pkg):
    return os.path.join(os.path.dirname(pkg), STATE_DIRNAME)


def take_lock(state):
    global _lock_fd
    if _lock_fd is not None:
        return
    path = os.path.join(state, "lock")
    try:
        os.makedirs(state, mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        raise Refused("%s is not writable by %s (and sudo -n is not available): nothing was "
                      "written" % (os.path.dirname(state), getpass.getuser())) from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise Refused("%s is on a read-only filesystem: nothing was written"
                      % os.path.dirname(state)) from None
    _lock_fd = hold_flock(fd, "another dynspec-patch run holds %s" % path)


def hold_flock(fd, busy):
    """Take the exclusive lock on ``fd`` without waiting and write who holds it; a lock held
    elsewhere closes ``fd`` and raises Busy with ``busy`` and the holder's line."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
        os.close(fd)
        raise Busy("%s (%s)" % (busy, holder or "unknown holder")) from None
    os.ftruncate(fd, 0)
    os.write(fd, ("pid %d user %s since %s\n" % (
        os.getpid(), os.environ.get("SUDO_USER") or getpass.getuser(),
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))).encode())
    return fd


def lock_holder(state):
    """Who holds ``<state>/lock`` right now (None if nobody); probes without keeping it."""
    path = os.path.join(state, "lock")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError:
        return os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown holder"
    finally:
        os.close(fd)


def read_json(path):
    data = read_bytes(path)
    if data is None:
        return None
    try:
        return json.loads(data.decode())
    except ValueError:
        return {"corrupt": True}


def audit(state, line):
    try:
        with open(os.path.join(state, "audit.log"), "a") as fh:
            fh.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), line))
    except OSError:
        pass


def recover_journal(state, pkg):
    """Finish or undo a commit that was interrupted between its renames (agent killed)."""
    journal = read_json(os.path.join(state, "journal.json"))
    if journal is None:
        return None
    pending = [f for f in journal.get("files", [])
               if sha256_file(os.path.join(pkg, f["path"])) != f["after_sha"]]
    rolled = all(
        (f["after_sha"] is None) or (f.get("tmp") and sha256_file(f["tmp"]) == f["after_sha"])
        for f in pending
    )
    if rolled:
        for f in pending:
            target = os.path.join(pkg, f["path"])
            if f["after_sha"] is None:
                if os.path.exists(target):
                    os.unlink(target)
            else:
                os.rename(f["tmp"], target)
        finish_commit(state, journal)
        audit(state, "recovered interrupted commit by finishing it (%d files)" % len(pending))
        return {"action": "rolled-forward", "files": [f["path"] for f in pending]}
    undo(state, pkg)
    audit(state, "recovered interrupted commit by undoing it")
    return {"action": "rolled-back"}


def finish_commit(state, journal):
    if "manifest" in journal:  # absent: leave the manifest alone (native config writes)
        manifest = unb64(journal["manifest"])
        path = os.path.join(state, "manifest.json")
        if manifest is None:
            if os.path.exists(path):
                os.unlink(path)
        else:
            write_atomic(path, manifest)
    if journal.get("clear_backup"):
        shutil.rmtree(os.path.join(state, "originals"), ignore_errors=True)
    pending = journal.get("pending")
    mark = os.path.join(state, "restart-pending.json")
    if pending:
        write_atomic(mark, json.dumps(pending, indent=1).encode())
    elif os.path.exists(mark) and journal.get("clear_pending", True):
        os.unlink(mark)
    os.unlink(os.path.join(state, "journal.json"))
    fsync_dir(state)


# --------------------------------------------------------------------------- requests


def op_hello(_args):
    return {
        "protocol": AGENT_PROTOCOL,
        "pid": os.getpid(),
        "euid": os.geteuid(),
        "user": getpass.getuser(),
        "sudo_user": os.environ.get("SUDO_USER"),
        "python": sys.executable,
        "python_version": list(sys.version_info[:3]),
    }


def select_servers(servers, pid, port):
    if pid is not None:
        servers = [s for s in servers if s["pid"] == pid or pid in s["tree"]]
    if port is not None:
        servers = [s for s in servers if server_port(s) == port or port in s["listening"]]
    return servers


def op_facts(args):
    servers = find_servers()
    chosen = select_servers(servers, args.get("pid"), args.get("port"))
    result = {"servers": servers, "selected": None, "package": None, "errors": []}
    if not servers:  # where did it go? another run restarting it, or a stopped container
        result["restarts"] = restarts_in_progress()
        result["stopped_containers"] = stopped_server_containers(args)
    server = chosen[0] if len(chosen) == 1 else None
    if server is not None and server.get("container_id") is not None:
        return facts_in_container(server, servers, args)
    if server is not None:
        if args.get("server_env") is not None:  # read by the host agent (see facts_in_container)
            server["env"], server["env_error"] = args["server_env"], None
        result["selected"] = server["pid"]
        server["server_info"] = server_info(server)
        if server["server_info"]["body"] is None and server["stdout"]:
            server["log_line"] = server_args_log_line(server["stdout"])
        python = {"argv0": server["argv"][0], "exe": server["exe"]}
        pkg, err = find_package(python, server["env"], server["cwd"], server["uid"])
        if pkg is None and server["env"] is None:
            err = (err or "") + " (environment unreadable)"
    else:
        same = {(s["argv"][0], s["exe"]) for s in (chosen or servers)}
        if len(same) == 1 and (chosen or servers):
            # several servers of one installation: the package is still unambiguous
            first = (chosen or servers)[0]
            python = {"argv0": first["argv"][0], "exe": first["exe"]}
            pkg, err = find_package(python, first["env"], first["cwd"], first["uid"])
        else:
            python = {"argv0": args.get("python") or sys.executable, "exe": None}
            pkg, err = find_package(python)
            if pkg is not None:
                pkg["fallback_python"] = True
    if pkg is None:
        result["errors"].append(err)
        return result
    pkg_dir = pkg["package_dir"]
    pkg["release"], pkg["release_file"] = release_of(pkg_dir)
    pkg["python"] = python
    result["package"] = pkg
    state = state_dir_for(pkg_dir)
    result["state_dir"] = state
    if args.get("lock"):
        take_lock(state)
        result["recovered"] = recover_journal(state, pkg_dir)
    else:
        result["busy"] = lock_holder(state)
        if result["busy"] is None and os.path.exists(os.path.join(state, "journal.json")):
            result["interrupted"] = True
    snapshot = {}
    for rel in args.get("paths", []):
        snapshot[rel] = b64(read_bytes(os.path.join(pkg_dir, rel)))
    result["snapshot"] = snapshot
    result["manifest"] = b64(read_bytes(os.path.join(state, "manifest.json")))
    result["pending"] = read_json(os.path.join(state, "restart-pending.json"))
    result["state_files"] = {
        name: b64(read_bytes(os.path.join(state, name))) for name in args.get("state_files", [])
    }
    if args.get("lock"):
        for rel in args.get("paths", []):
            target = os.path.join(pkg_dir, rel)
            stale = os.path.join(os.path.dirname(target), STAGE_NAME % os.path.basename(target))
            if os.path.exists(stale):
                os.unlink(stale)
    result["writable"] = os.access(pkg_dir, os.W_OK)
    return result


def compile_check(python, paths):
    code = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    compile(open(p, 'rb').read(), p, 'exec', dont_inherit=True)\n"
    )
    argv0, exe = interpreter(python)
    proc = subprocess.run([argv0, "-I", "-S", "-c", code, *paths], executable=exe,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise Refused("compile check with %s failed: %s" % (argv0, " | ".join(tail)))


def op_stage(args):
    """Write every new file as a temp file beside its target, then compile them all."""
    pkg, python = args["package_dir"], args["python"]
    staged, written = [], []
    try:
        for f in args["files"]:
            target = os.path.join(pkg, f["path"])
            current = sha256_file(target)
            if current != f["before_sha"]:
                raise Refused("%s changed since it was read (sha256 %s, expected %s)" % (
                    f["path"], current, f["before_sha"]))
            entry = {"path": f["path"], "before_sha": f["before_sha"], "after_sha": f["after_sha"],
                     "tmp": None}
            if f["after_sha"] is not None:
                data = unb64(f["after"])
                if sha256_bytes(data) != f["after_sha"]:
                    raise Refused("%s: upload corrupted" % f["path"])
                directory = os.path.dirname(target)
                if not os.path.isdir(directory):
                    raise Refused("%s: directory %s does not exist" % (f["path"], directory))
                tmp = os.path.join(directory, STAGE_NAME % os.path.basename(target))
                written.append(tmp)
                _staged.append(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                like = target if os.path.exists(target) else os.path.join(pkg, "__init__.py")
                if os.path.exists(like):
                    copy_owner_mode(like, tmp)
                if sha256_file(tmp) != f["after_sha"]:
                    raise Refused("%s: staged copy does not read back" % f["path"])
                entry["tmp"] = tmp
            staged.append(entry)
        py = [e["tmp"] for e in staged if e["tmp"] and e["path"].endswith(".py")]
        if py:
            compile_check(python, py)
    except BaseException:
        for tmp in written:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return {"staged": staged}


def op_commit(args):
    """Save undo copies (+ originals on first apply), then rename every staged file in place."""
    pkg, state = args["package_dir"], args["state_dir"]
    take_lock(state)
    files = args["files"]
    for f in files:
        if sha256_file(os.path.join(pkg, f["path"])) != f["before_sha"]:
            raise Refused("%s changed since it was staged" % f["path"])
        if f["tmp"] and sha256_file(f["tmp"]) != f["after_sha"]:
            raise Refused("%s: staged temp file is gone or changed" % f["path"])
    undo_dir = os.path.join(state, "undo")
    shutil.rmtree(undo_dir, ignore_errors=True)
    os.makedirs(undo_dir)
    meta = {"files": [], "manifest": b64(read_bytes(os.path.join(state, "manifest.json"))),
            "pending": read_json(os.path.join(state, "restart-pending.json")),
            "manifest_managed": "manifest" in args}
    backup_dir = os.path.join(state, "originals")
    for f in files:
        target = os.path.join(pkg, f["path"])
        data = read_bytes(target)
        meta["files"].append({"path": f["path"], "existed": data is not None,
                              "sha": f["before_sha"], "after_sha": f["after_sha"]})
        if data is not None:
            copy = os.path.join(undo_dir, f["path"])
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            shutil.copy2(target, copy)
            if args.get("backup"):
                keep = os.path.join(backup_dir, f["path"])
                if sha256_file(keep) is None:
                    os.makedirs(os.path.dirname(keep), exist_ok=True)
                    shutil.copy2(target, keep)
    write_atomic(os.path.join(undo_dir, "meta.json"), json.dumps(meta).encode())
    journal = {"files": files, "pending": args.get("pending"),
               "clear_backup": bool(args.get("clear_backup"))}
    if "manifest" in args:
        journal["manifest"] = args["manifest"]
    write_atomic(os.path.join(state, "journal.json"), json.dumps(journal).encode())
    for i, f in enumerate(files):
        target = os.path.join(pkg, f["path"])
        if f["after_sha"] is None:
            if os.path.exists(target):
                os.unlink(target)
        else:
            os.rename(f["tmp"], target)
        fsync_dir(os.path.dirname(target))
        if args.get("fault") == "die-mid-commit" and i == 0 and len(files) > 1:
            os._exit(9)  # test hook: the agent dies between two renames
    finish_commit(state, journal)
    del _staged[:]
    audit(state, "%s: %s" % (args.get("action", "commit"), ", ".join(f["path"] for f in files)))
    return {"committed": [f["path"] for f in files]}


def undo(state, pkg):
    """Put back what the last commit replaced (files, manifest, restart mark)."""
    undo_dir = os.path.join(state, "undo")
    meta = read_json(os.path.join(undo_dir, "meta.json"))
    if not meta or meta.get("corrupt"):
        raise Refused("no undo information in %s" % undo_dir)
    for f in meta["files"]:
        target = os.path.join(pkg, f["path"])
        if f["existed"]:
            copy = os.path.join(undo_dir, f["path"])
            if sha256_file(copy) != f["sha"]:
                raise Refused("undo copy of %s is damaged" % f["path"])
            tmp = os.path.join(os.path.dirname(target),
                               ".%s.dynspec-undo.tmp" % os.path.basename(target))
            shutil.copy2(copy, tmp)
            os.rename(tmp, target)
        elif os.path.exists(target):
            os.unlink(target)
        fsync_dir(os.path.dirname(target))
    manifest = unb64(meta.get("manifest"))
    mpath = os.path.join(state, "manifest.json")
    if not meta.get("manifest_managed", True):
        pass  # that commit did not touch the manifest (native config)
    elif manifest is None:
        if os.path.exists(mpath):
            os.unlink(mpath)
    else:
        write_atomic(mpath, manifest)
    if manifest is None and meta.get("manifest_managed", True):
        shutil.rmtree(os.path.join(state, "originals"), ignore_errors=True)
    mark = os.path.join(state, "restart-pending.json")
    if meta.get("pending"):
        write_atomic(mark, json.dumps(meta["pending"]).encode())
    elif os.path.exists(mark):
        os.unlink(mark)
    journal = os.path.join(state, "journal.json")
    if os.path.exists(journal):
        os.unlink(journal)
    return [f["path"] for f in meta["files"]]


def op_undo(args):
    take_lock(args["state_dir"])
    return {"restored": undo(args["state_dir"], args["package_dir"])}


def op_discard_staged(args):
    for f in args.get("files", []):
        if f.get("tmp") and os.path.exists(f["tmp"]):
            os.unlink(f["tmp"])
    del _staged[:]
    return {}


def op_write_file(args):
    take_lock(args["state_dir"])
    path = os.path.join(args["state_dir"], args["name"])
    write_atomic(path, unb64(args["data"]))
    return {"path": path}


def op_remove_file(args):
    take_lock(args["state_dir"])
    path = os.path.join(args["state_dir"], args["name"])
    try:
        os.unlink(path)
    except FileNotFoundError:
        return {"removed": None}
    fsync_dir(args["state_dir"])
    return {"removed": path}


# --------------------------------------------------------------------------- restart


def stop_tree(server, stop_timeout):
    """TERM the whole tree (and process group), wait, then KILL; zombies count as dead."""
    root = server["pid"]
    if not alive(root):
        return {"already_gone": True, "killed": []}
    pids = [root, *descendants(root)]
    st = proc_stat(root)
    pgid = st["pgid"] if st else None
    if pgid and pgid != os.getpgrp():
        for pid in all_pids():
            st = proc_stat(pid)
            if st and st["pgid"] == pgid and pid not in pids:
                pids.append(pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + stop_timeout
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    killed = [p for p in pids if alive(p)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    if left:
        raise Refused("processes %s survived SIGKILL" % left)
    return {"stopped": pids, "killed": killed}


def wait_port_closed(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if port not in listening_ports():
            return True
        time.sleep(0.1)
    return False


def wait_gpu_free(pids, timeout, env=None):
    """Wait until none of ``pids`` holds GPU memory (``nvidia-smi`` on the agent's PATH or the
    server's)."""
    search = os.pathsep.join(p for p in ((env or {}).get("PATH"), os.environ.get("PATH")) if p)
    smi = shutil.which("nvidia-smi", path=search or None)
    if not smi:
        return "no nvidia-smi"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 timeout=30).stdout.decode()
        except (OSError, subprocess.TimeoutExpired):
            return "nvidia-smi failed"
        held = {int(x) for x in out.split() if x.strip().isdigit()} & set(pids)
        if not held:
            return "free"
        time.sleep(1)
    return "still held after %ds" % timeout


def demote(uid, gid, sig_ign=None):
    def _fn():
        if sig_ign is not None:
            # the same ignored signals as the original (e.g. nohup's SIGHUP), the rest default
            mask = int(sig_ign, 16)
            for signum in range(1, 32):
                if signum in (signal.SIGKILL, signal.SIGSTOP):
                    continue
                try:
                    signal.signal(signum, signal.SIG_IGN if mask >> (signum - 1) & 1
                                  else signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
        if os.geteuid() == 0 and uid is not None and uid != 0:
            gid_ = None if gid in (None, -1) else gid
            try:
                user = pwd.getpwuid(uid)
                os.initgroups(user.pw_name, gid_ if gid_ is not None else user.pw_gid)
                os.setgid(gid_ if gid_ is not None else user.pw_gid)
            except KeyError:
                pass
            os.setuid(uid)
    return _fn


def launch(spec, log_path):
    """Start the server detached (own session), stdout+stderr into ``log_path``."""
    uid = spec.get("uid")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if os.geteuid() == 0 and uid not in (None, 0):
        os.fchown(fd, uid, -1)
    exe = spec.get("exe")
    if not exe or exe.endswith(" (deleted)") or not os.path.exists(exe):
        exe = None
    try:
        proc = subprocess.Popen(
            spec["argv"], executable=exe, cwd=spec.get("cwd") or "/", env=spec.get("env"),
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
            preexec_fn=demote(uid, spec.get("gid"), spec.get("sig_ign") or "0"),
        )
    finally:
        os.close(fd)
    return proc


def log_tail(path, n=5):
    data = read_bytes(path) or b""
    return " | ".join(data.decode("utf-8", "replace").strip().splitlines()[-n:])


def gate(proc, host, port, api_key, timeout, log_path):
    """Wait for /health, then one tiny generation; fail fast if the process dies."""
    deadline = time.time() + timeout
    last = None
    step = "health"
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Refused("server exited with status %s during start-up: %s" % (
                proc.returncode, log_tail(log_path)))
        budget = max(1.0, deadline - time.time())
        if step == "health":
            status, body = http_get(host, port, "/health", api_key, timeout=min(10, budget))
            if status == 200:
                step = "generate"
                progress("health ok; checking a tiny generation")
                continue
        else:
            status, body = http_get(host, port, "/health_generate", api_key,
                                    timeout=min(60, budget))
            if status == 404:
                payload = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1}})
                status, body = http_get(host, port, "/generate", api_key,
                                        timeout=min(60, budget), data=payload.encode())
            if status == 200:
                return
        last = "%s -> %s %s" % (step, status, body[:120].decode("utf-8", "replace"))
        time.sleep(0.2)
    raise Refused("server not healthy within %ds (last: %s)" % (timeout, last))


def prove(host, port, api_key, expect):
    info = server_info({"argv": ["--api-key", api_key] if api_key else [], "host": host,
                        "port": port, "listening": []})
    body = info["body"]
    if body is None:
        raise Refused("cannot read server info after restart: %s" % info["tried"])
    wrong = {}
    for key, value in (expect or {}).items():
        if value == "<present>":
            if key not in body:
                wrong[key] = "absent"
        elif value == "<absent>":
            if key in body:
                wrong[key] = body[key]
        elif body.get(key) != value:
            wrong[key] = body.get(key, "absent")
    if wrong:
        raise Refused("server runs but does not report the patch: %s" % wrong)
    return {"endpoint": info["endpoint"], "checked": expect}


def find_by_port(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for s in find_servers():
            if server_port(s) == port or port in s["listening"]:
                return s
        time.sleep(0.5)
    return None


def start_and_check(spec, server, args, log_path, expect):
    host, port = connect_host(server), server_port(server)
    api_key = flag_value(spec.get("argv") or server["argv"], "--api-key")
    if args.get("restart_cmd"):
        progress("running restart command")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            rc = subprocess.run(["/bin/sh", "-c", args["restart_cmd"]], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=subprocess.STDOUT, timeout=600).returncode
        finally:
            os.close(fd)
        if rc != 0:
            raise Refused("restart command exited %d: %s" % (rc, log_tail(log_path)))
        deadline = time.time() + args.get("stop_timeout", 60)
        while time.time() < deadline and alive(server["pid"]):
            time.sleep(0.05)
        if alive(server["pid"]):
            raise Refused(
                "the restart command left the old server (pid %d) running" % server["pid"])
        gate(None, host, port, api_key, args["health_timeout"], log_path)
        new = find_by_port(port, 30)
        pid = new["pid"] if new else None
        gpu = "not checked (restart command)"
    else:
        stop = stop_tree(server, args.get("stop_timeout", 60))
        how = "KILL needed" if stop.get("killed") else "TERM"
        progress("stopped pid %d (%s)" % (server["pid"], how))
        if not wait_port_closed(port, args.get("port_timeout", 120)):
            raise Refused("port %d still in use after the server stopped" % port)
        gpu = wait_gpu_free(stop.get("stopped", []), args.get("gpu_timeout", 300),
                            server.get("env"))
        if gpu.startswith("still held"):
            raise Refused("GPU memory of the old server is %s" % gpu)
        proc = launch(spec, log_path)
        progress("launched pid %d; waiting for health (timeout %ds)"
                 % (proc.pid, args["health_timeout"]))
        gate(proc, host, port, api_key, args["health_timeout"], log_path)
        pid = proc.pid
    proof = prove(host, port, api_key, expect)
    return {"pid": pid, "log": log_path, "proof": proof, "gpu": gpu}


# While a restart has the server stopped, no process says where it was: a run that arrives then
# finds no server. So a restart holds a marker per port in the host's temp dir (flock'd, like
# the lock, so it dies with its agent), naming the run, the package and the server's log.
RESTARTS_DIRNAME = "dynspec-patch-restarts"


def restarts_dir():
    return os.path.join(tempfile.gettempdir(), RESTARTS_DIRNAME)


def _own_dir(path):
    """``path`` as a directory of this user's only (a temp dir others can write to holds it)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.geteuid()


def mark_restart(server, state, pkg, log_path):
    """Hold ``<tmp>/dynspec-patch-restarts/port-P`` for the length of a restart (best effort:
    without it only the explanation of a missing server is lost)."""
    if not _own_dir(restarts_dir()):
        return None
    path = os.path.join(restarts_dir(), "port-%d" % server_port(server))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({
        "port": server_port(server), "agent_pid": os.getpid(),
        "user": os.environ.get("SUDO_USER") or getpass.getuser(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "server_pid": server["pid"], "package_dir": pkg, "state_dir": state, "log": log_path,
    }).encode())
    return fd, path


def unmark_restart(mark):
    if mark is None:
        return
    fd, path = mark
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def restarts_in_progress():
    """Every restart marker: ``in_progress`` while its agent holds it, else the restart was
    cut short (its agent killed) with the server perhaps still stopped."""
    out = []
    try:
        names = sorted(os.listdir(restarts_dir()))
    except OSError:
        return out
    for name in names:
        try:
            fd = os.open(os.path.join(restarts_dir(), name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                held = False
            except OSError:
                held = True
            try:
                mark = json.loads(os.read(fd, 65536).decode("utf-8", "replace"))
            except ValueError:
                continue
        finally:
            os.close(fd)
        if not isinstance(mark, dict):
            continue
        if not held and not os.path.isdir(mark.get("package_dir") or ""):
            try:  # a cut-short restart of an installation that is gone: nothing to explain
                os.unlink(os.path.join(restarts_dir(), name))
            except OSError:
                pass
            continue
        mark["in_progress"] = held
        out.append(mark)
    return out


def op_restart(args):
    """Restart with the new command; on failure undo the last commit and restart the original."""
    if args["server"].get("container"):
        return restart_container(args)
    state, pkg = args["state_dir"], args["package_dir"]
    take_lock(state)
    server = args["server"]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    log_path = os.path.join(state, "server-%s.log" % stamp)
    mark = mark_restart(server, state, pkg, log_path)
    try:
        return restart_bare(args, state, pkg, server, stamp, log_path)
    finally:
        unmark_restart(mark)


def restart_bare(args, state, pkg, server, stamp, log_path):
    """``op_restart`` on the host itself (no container)."""
    new = dict(server, argv=args["argv"])
    try:
        done = start_and_check(new, server, args, log_path, args.get("expect"))
    except Exception as exc:
        reason = str(exc) or exc.__class__.__name__
        audit(state, "restart failed: %s; rolling back" % reason)
        progress("restart failed: %s; restoring the original files" % reason)
        result = {"ok_restart": False, "reason": reason, "log": log_path}
        try:
            if args.get("undo", True) and os.path.exists(os.path.join(state, "undo", "meta.json")):
                result["restored"] = undo(state, pkg)
            current = find_by_port(server_port(server), 0.1)
            if current is not None:
                stop_tree(current, args.get("stop_timeout", 60))
                wait_port_closed(server_port(server), args.get("port_timeout", 120))
            again = start_and_check(server, server, args,
                                    os.path.join(state, "server-%s-rollback.log" % stamp),
                                    args.get("expect_original"))
            result["original_healthy"] = True
            result["pid"] = again["pid"]
        except Exception as exc2:
            result["original_healthy"] = False
            result["rollback_error"] = str(exc2)
        return result
    op_restart_done({"state_dir": state, "pid": done["pid"]})
    done["ok_restart"] = True
    return done


def op_restart_done(args):
    """After a proven restart: no pending mark, no undo copies (the restart cannot be undone)."""
    state = args["state_dir"]
    take_lock(state)
    mark = os.path.join(state, "restart-pending.json")
    if os.path.exists(mark):
        os.unlink(mark)
    shutil.rmtree(os.path.join(state, "undo"), ignore_errors=True)
    audit(state, "restarted: pid %s" % args.get("pid"))
    return {}


# --------------------------------------------------------------------------- containers
#
# A server whose mount namespace is not ours runs in a container. The host agent (this process,
# on the host) identifies the container and owns everything the host does: ``docker inspect``,
# ``docker restart``, the health gate, ``docker commit``. Everything that touches the package
# runs in a second agent started inside the container with ``docker exec`` and the container's
# own Python (this same program): facts, stage (compile check), commit, undo, and the lock, all
# on container paths exactly as on a bare host. Requests for it are forwarded (INNER_OPS).

CONTAINER_ID = re.compile(r"\b[0-9a-f]{64}\b")
INNER_OPS = ("stage", "commit", "undo", "discard_staged", "write_file", "remove_file")
_docker = {"client": None, "host": None}
_inner = None  # the agent inside the selected server's container, once facts started it
_container_lock_fd = None


def container_lock_dir(cid):
    return os.path.join(tempfile.gettempdir(), "dynspec-patch-container-%s" % cid[:12])


def lock_container(cid):
    """A host-side lock per container, held by this agent for the whole command: the lock in
    the container dies with the agent there when ``docker restart`` stops its processes."""
    global _container_lock_fd
    if _container_lock_fd is not None:
        return
    os.makedirs(container_lock_dir(cid), mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(container_lock_dir(cid), "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    _container_lock_fd = hold_flock(
        fd, "another dynspec-patch run works on container %s" % cid[:12])


def same_root(pid):
    """Whether ``pid`` sees this host's ``/`` (a systemd unit with PrivateTmp has its own
    mount namespace but the same root; a container has a root of its own)."""
    if readlink(os.path.join(PROC, str(pid), "ns", "mnt")) == readlink("/proc/self/ns/mnt"):
        return True
    try:
        theirs, ours = os.stat(os.path.join(PROC, str(pid), "root")), os.stat("/")
    except OSError:
        return True  # not ours to read (no root): the bare-host path reports what fails
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def container_id_of(pid):
    """The Docker container ``pid`` runs in: ``None`` on this host's own filesystem, else the
    id from its cgroup path or its containerd shim's ``-id`` ("" if it names none)."""
    if same_root(pid):
        return None
    for line in (_read_proc(pid, "cgroup") or b"").decode("utf-8", "replace").splitlines():
        found = CONTAINER_ID.findall(line)
        if found:
            return found[-1]
    seen, current = set(), pid
    while current > 1 and current not in seen:
        seen.add(current)
        argv = argv_of(current) or []
        if argv and os.path.basename(argv[0]).startswith("containerd-shim"):
            return flag_value(argv, "-id") or ""
        st = proc_stat(current)
        current = st["ppid"] if st else 0
    return ""


def ns_pid(pid):
    """``pid`` as its own PID namespace (the container) numbers it."""
    value = None
    for line in (_read_proc(pid, "status") or b"").decode().splitlines():
        if line.startswith("NSpid:"):
            value = int(line.split()[-1])
    return value if value is not None else pid


def dockerds():
    """``(-H, data root)`` of every dockerd running on the host (``-H`` None: the default)."""
    out = []
    for pid in all_pids():
        argv = argv_of(pid)
        if not argv or os.path.basename(argv[0]) != "dockerd":
            continue
        root = flag_value(argv, "--data-root") or flag_value(argv, "-g") or "/var/lib/docker"
        out.append((flag_value(argv, "-H") or flag_value(argv, "--host"), root))
    return out


def docker_daemon_for(cid):
    """``-H`` of the dockerd whose data root holds container ``cid`` (several engines may run)."""
    for host, root in dockerds():
        if os.path.isdir(os.path.join(root, "containers", cid)):
            return host
    return None


def runs_a_server(command):
    """A container command that starts an SGLang server (also through ``sh -c "..."``)."""
    if is_server_argv(command):
        return True
    text = " ".join(command)
    return any(module in text for module in LAUNCH_MODULES) or "sglang serve" in text


def stopped_server_containers(args):
    """Docker containers on this host whose command is an SGLang server and that do not run
    (exited, created, dead, or restarting after a crash): where a missing server went. Each
    with the dynspec-patch run working on it, if one holds its lock."""
    client = args.get("docker_client") or shutil.which("docker")
    if not client or not os.access(client, os.X_OK):
        return []
    # the daemons that run here (no dockerd: no container can be stopped and started here)
    daemons = [args["docker_host"]] if args.get("docker_host") else \
        sorted({host for host, _ in dockerds()}, key=str)
    found = []
    for host in daemons:
        base = [client, *(["-H", host] if host else [])]
        try:
            listed = subprocess.run(
                [*base, "ps", "-aq", "--no-trunc", "--filter", "status=exited",
                 "--filter", "status=created", "--filter", "status=dead",
                 "--filter", "status=restarting"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                timeout=60)
            ids = listed.stdout.decode().split() if listed.returncode == 0 else []
            if not ids:
                continue
            shown = subprocess.run([*base, "inspect", "--type", "container", *ids],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        try:
            containers = json.loads(shown.stdout.decode() or "[]")
        except ValueError:
            continue
        for c in containers:
            command = [c.get("Path") or "", *(c.get("Args") or [])]
            if not runs_a_server(command):
                continue
            state = c.get("State") or {}
            found.append({
                "id": c["Id"], "name": c.get("Name", "").lstrip("/"),
                "image": (c.get("Config") or {}).get("Image"),
                "status": state.get("Status"), "exit_code": state.get("ExitCode"),
                "finished_at": state.get("FinishedAt"), "docker_host": host,
                "busy": lock_holder(container_lock_dir(c["Id"])),
            })
    return found


def use_docker(args, cid):
    client = args.get("docker_client") or shutil.which("docker")
    if not client or not os.access(client, os.X_OK):
        raise Refused("the server runs in container %s, but there is no docker client on the host "
                      "(%s); name it with DYNSPEC_DOCKER_CLIENT where dynspec-patch runs: nothing "
                      "was written" % (cid[:12], client or "docker not on PATH"))
    _docker["client"] = client
    _docker["host"] = args.get("docker_host") or docker_daemon_for(cid)


def docker_argv(*args):
    host = ["-H", _docker["host"]] if _docker["host"] else []
    return [_docker["client"], *host, *args]


def docker(*args, timeout=120):
    proc = subprocess.run(docker_argv(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout)
    proc.err = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    return proc


def inspect_container(cid):
    proc = docker("inspect", "--type", "container", cid)
    if proc.returncode != 0:
        raise Refused("docker inspect %s failed: %s" % (cid[:12], proc.err[0]))
    c = json.loads(proc.stdout.decode())[0]
    cfg, host_cfg, state = c.get("Config") or {}, c.get("HostConfig") or {}, c.get("State") or {}
    labels = cfg.get("Labels") or {}
    if "com.docker.compose.project" in labels:
        started = "docker compose (project %s, service %s)" % (
            labels.get("com.docker.compose.project"), labels.get("com.docker.compose.service"))
    else:
        started = "docker run (or the Docker API)"
    policy = host_cfg.get("RestartPolicy") or {}
    return {
        "id": c["Id"], "name": c.get("Name", "").lstrip("/"), "image": cfg.get("Image"),
        "image_id": c.get("Image"), "created": c.get("Created"),
        "restart_policy": policy.get("Name") or "no", "started_by": started,
        "command": [c.get("Path"), *(c.get("Args") or [])],
        "entrypoint": cfg.get("Entrypoint"), "cmd": cfg.get("Cmd"),
        "working_dir": cfg.get("WorkingDir"), "user": cfg.get("User"),
        "network_mode": host_cfg.get("NetworkMode"), "init": host_cfg.get("Init"),
        "auto_remove": bool(host_cfg.get("AutoRemove")),
        "read_only": bool(host_cfg.get("ReadonlyRootfs")), "main_pid": state.get("Pid"),
        "docker_client": _docker["client"], "docker_host": _docker["host"],
    }


def own_code():
    """This agent's source as the bootstrap takes it (``sys.argv[1]`` when shipped over SSH)."""
    if len(sys.argv) > 1 and sys.argv[0] == "-c":
        return sys.argv[1]
    with open(os.path.abspath(__file__), "rb") as fh:
        return base64.b64encode(zlib.compress(fh.read(), 9)).decode()


class InnerAgent:
    """This agent run inside a container (``docker exec -i -u 0``, the container's Python)."""

    def __init__(self, container, python):
        self.container = container
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - the exec's stderr, closed with it
        self.proc = subprocess.Popen(
            docker_argv("exec", "-i", "-u", "0", container["id"], python, "-c", BOOTSTRAP,
                        own_code()),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)
        hello = self._read()
        if hello is None:
            raise Refused("cannot run the agent inside container %s with its %s (needs Python "
                          ">= 3.8): %s; nothing was written" % (
                              container["name"], python, self._stderr() or "no output"))
        self.hello = hello["result"]

    def _stderr(self):
        self.errors.seek(0)
        lines = self.errors.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else ""

    def _read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                return None
            try:
                msg = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                continue
            if "progress" in msg:
                progress("[%s] %s" % (self.container["name"], msg["progress"]))
                continue
            return msg

    def request(self, op, args):
        try:
            self.proc.stdin.write((json.dumps({"op": op, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass
        msg = self._read()
        if msg is None:
            raise Refused("the agent inside container %s stopped during %s: %s" % (
                self.container["name"], op, self._stderr() or "no output"))
        if msg.get("ok"):
            return msg["result"]
        if msg.get("kind") == "busy":
            raise Busy(msg["error"])
        if msg.get("kind") == "refused":
            raise Refused(msg["error"])
        raise RuntimeError("in container %s: %s" % (self.container["name"], msg.get("error")))

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.errors.close()


def start_inner(container, python):
    global _inner
    if _inner is not None:
        _inner.close()
    _inner = None  # a failed start must not leave a dead agent to forward to
    _inner = InnerAgent(container, python)
    return _inner


def layer_changes(cid, directory):
    """Paths under ``directory`` that the container's own layer changed (``docker diff``):
    what a container re-created from its image would not have."""
    proc = docker("diff", cid)
    if proc.returncode != 0:
        return None
    prefix = directory.rstrip("/") + "/"
    out = []
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        kind, _, path = line.partition(" ")
        if path.startswith(prefix) and "/__pycache__" not in path:
            out.append({"change": kind, "path": path})
    return out


def facts_in_container(server, servers, args):
    """``facts`` for a server in a container: the host's view of the processes, the
    container's view (through the inner agent) of the package, its state and its server."""
    cid = server["container_id"]
    if not cid:
        raise Refused("pid %d runs under a root filesystem of its own that is not a Docker "
                      "container (no container id in its cgroups or ancestors): nothing was "
                      "written" % server["pid"])
    use_docker(args, cid)
    if args.get("lock"):
        lock_container(cid)
    container = inspect_container(cid)
    server["container"] = container
    server["container_pid"] = ns_pid(server["pid"])
    python = server["exe"] if server.get("exe") and server["exe"].startswith("/") else \
        server["argv"][0]
    inner = start_inner(container, python)
    inner_args = dict(args, pid=server["container_pid"], port=None, server_env=server["env"])
    result = inner.request("facts", inner_args)
    inside = next((s for s in result.get("servers", ())
                   if s["pid"] == server["container_pid"]), None)
    if inside is not None:
        for key in ("server_info", "log_line"):
            if key in inside:
                server[key] = inside[key]
    result["servers"], result["selected"] = servers, server["pid"]
    result["container_agent"] = inner.hello
    if not args.get("lock") and not result.get("busy"):
        result["busy"] = lock_holder(container_lock_dir(cid))
    package = (result.get("package") or {}).get("package_dir")
    if package:
        container["layer_changes"] = layer_changes(cid, os.path.dirname(package))
    return result


class RunningContainer:
    """``gate``'s process handle for a container: ``poll()`` is its exit code once it stops."""

    def __init__(self, cid):
        self.cid = cid
        self.returncode = None

    def poll(self):
        proc = docker("inspect", "--type", "container", "-f",
                      "{{.State.Running}} {{.State.Restarting}} {{.State.ExitCode}}", self.cid)
        if proc.returncode != 0:
            self.returncode = "gone"
            return self.returncode
        running, restarting, code = proc.stdout.decode().split()
        if running == "true" and restarting == "false":
            return None
        self.returncode = "%s (restarting)" % code if restarting == "true" else code
        return self.returncode


def container_log_tail(cid, since):
    proc = docker("logs", "--since", since, "--tail", "5", cid)
    text = (proc.stdout + proc.stderr).decode("utf-8", "replace").strip().splitlines()
    return " | ".join(text[-5:])


def restart_and_gate(server, args, expect, log_path, restart_cmd):
    """Restart the container (``docker restart``, or the user's command), gate on health and
    a tiny generation, prove ``expect`` in server info; the new server's host pid."""
    container = server["container"]
    host, port = connect_host(server), server_port(server)
    api_key = flag_value(server["argv"], "--api-key")
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    if restart_cmd:
        progress("running restart command")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            rc = subprocess.run(["/bin/sh", "-c", restart_cmd], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=subprocess.STDOUT, timeout=600).returncode
        finally:
            os.close(fd)
        if rc != 0:
            raise Refused("restart command exited %d: %s" % (rc, log_tail(log_path)))
        watch = None
    else:
        stop_timeout = int(args.get("stop_timeout", 60))
        progress("docker restart %s" % container["name"])
        proc = docker("restart", "-t", str(stop_timeout), container["id"],
                      timeout=stop_timeout + 120)
        if proc.returncode != 0:
            raise Refused("docker restart %s failed: %s" % (container["name"], proc.err[0]))
        watch = RunningContainer(container["id"])
    deadline = time.time() + args.get("stop_timeout", 60)
    while time.time() < deadline and alive(server["pid"]):
        time.sleep(0.05)
    if alive(server["pid"]):
        raise Refused("the old server (pid %d) still runs after the restart" % server["pid"])
    try:
        gate(watch, host, port, api_key, args["health_timeout"], log_path)
    except Refused as exc:
        raise Refused("%s; docker logs: %s" % (
            exc, container_log_tail(container["id"], since))) from None
    proof = prove(host, port, api_key, expect)
    new = find_by_port(port, 30)
    return {"pid": new["pid"] if new else None, "proof": proof,
            "log": log_path if restart_cmd else "docker logs %s" % container["name"],
            "gpu": "not checked (container)",
            "container_id": new.get("container_id") if new else None}


def undo_stopped(container, state, pkg, stop_timeout):
    """Undo the last commit in a container that may be crash-looping (no ``docker exec``
    then): stop it, mount its overlay2 layers on the host the way dockerd does, and run the
    same ``undo`` on the mounted tree."""
    proc = docker("stop", "-t", str(int(stop_timeout)), container["id"], timeout=stop_timeout + 60)
    if proc.returncode != 0:
        raise Refused("docker stop %s failed: %s" % (container["name"], proc.err[0]))
    proc = docker("inspect", "--type", "container", "-f", "{{json .GraphDriver}}", container["id"])
    if proc.returncode != 0:
        raise Refused("docker inspect %s failed: %s" % (container["name"], proc.err[0]))
    driver = json.loads(proc.stdout.decode())
    if driver.get("Name") != "overlay2":
        raise Refused("storage driver %s: cannot reach the stopped container's files"
                      % driver.get("Name"))
    data = driver["Data"]
    layers = os.path.dirname(os.path.dirname(data["UpperDir"]))  # <data-root>/overlay2
    lowers = []
    for lower in data["LowerDir"].split(":"):  # short links keep the options under a page
        with open(os.path.join(os.path.dirname(lower), "link")) as fh:
            lowers.append("l/" + fh.read().strip())
    own = os.path.relpath(os.path.dirname(data["UpperDir"]), layers)
    target = tempfile.mkdtemp(prefix="dynspec-container-")
    options = "lowerdir=%s,upperdir=%s/diff,workdir=%s/work" % (":".join(lowers), own, own)
    mount = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, target],
                           cwd=layers, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if mount.returncode != 0:
        os.rmdir(target)
        raise Refused("cannot mount the stopped container's layers: %s"
                      % mount.stderr.decode("utf-8", "replace").strip())
    try:
        return undo(target + state, target + pkg)
    finally:
        subprocess.run(["umount", target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.rmdir(target)


def restart_container(args):
    """``op_restart`` for a server in a container; on failure undo the commit in the
    container's files and start the original again."""
    global _inner
    server = args["server"]
    container = server["container"]
    log_path = os.path.join(tempfile.gettempdir(), "dynspec-patch-%s-%s.log" % (
        container["id"][:12], time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())))
    python = server["exe"] if (server.get("exe") or "").startswith("/") else server["argv"][0]
    try:
        done = restart_and_gate(server, args, args.get("expect"), log_path,
                                args.get("restart_cmd"))
    except Exception as exc:
        reason = str(exc) or exc.__class__.__name__
        progress("restart failed: %s; restoring the original files in %s"
                 % (reason, container["name"]))
        result = {"ok_restart": False, "reason": reason,
                  "log": log_path if args.get("restart_cmd") else "docker logs %s" % (
                      container["name"])}
        try:
            if _inner is not None:  # it died with the container's processes
                _inner.close()
                _inner = None
            if args.get("undo", True):
                result["restored"] = undo_stopped(container, args["state_dir"],
                                                  args["package_dir"], args.get("stop_timeout", 60))
            again = restart_and_gate(server, args, args.get("expect_original"), log_path, None)
            result["original_healthy"] = True
            result["pid"] = again["pid"]
        except Exception as exc2:
            result["original_healthy"] = False
            result["rollback_error"] = str(exc2)
        return result
    if done["container_id"] and done["container_id"] != container["id"]:
        container = inspect_container(done["container_id"])  # --restart-cmd re-created it
    inner = start_inner(container, python)
    inner.request("restart_done", {"state_dir": args["state_dir"], "pid": done["pid"]})
    done["ok_restart"] = True
    done["container"] = container["name"]
    return done


def op_commit_image(args):
    """``docker commit`` the container as ``tag`` (``changes``: Dockerfile lines such as CMD)."""
    argv = ["commit"]
    for change in args.get("changes") or ():
        argv += ["--change", change]
    argv += ["-m", args.get("message") or "dynspec-patch", args["container"], args["tag"]]
    proc = docker(*argv, timeout=600)
    if proc.returncode != 0:
        raise Refused("docker commit failed: %s" % proc.err[0])
    return {"image_id": proc.stdout.decode().strip(), "tag": args["tag"]}


OPS = {
    "hello": op_hello,
    "facts": op_facts,
    "stage": op_stage,
    "commit": op_commit,
    "undo": op_undo,
    "discard_staged": op_discard_staged,
    "write_file": op_write_file,
    "remove_file": op_remove_file,
    "restart": op_restart,
    "restart_done": op_restart_done,
    "commit_image": op_commit_image,
}


def main():
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a dropped connection must not cut a step short
    emit({"ok": True, "result": op_hello({})})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            if _inner is not None and req["op"] in INNER_OPS:
                result = _inner.request(req["op"], req.get("args") or {})
            else:
                result = OPS[req["op"]](req.get("args") or {})
            emit({"ok": True, "result": result})
        except (Refused, Busy) as exc:
            emit({"ok": False, "kind": exc.kind, "error": str(exc)})
        except Exception as exc:
            emit({"ok": False, "kind": "error", "error": "%s: %s" % (exc.__class__.__name__, exc)})
        if _out is None:
            break
    for tmp in _staged:  # the client left between stage and commit: leave no debris
        if os.path.exists(tmp):
            os.unlink(tmp)
    if _inner is not None:
        _inner.close()


if __name__ == "__main__":
    main()
