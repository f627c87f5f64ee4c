#!/usr/bin/env bash
# Build .whl/ (git-ignored, never committed): the wheels the GPU machines' image lacks for the GPU tests
# and benchmarks, for its python3.12 / x86-64 / manylinux. The image has torch, triton, transformers,
# numpy, safetensors, pytest and hypothesis; it has no av, zstandard or PyNvVideoCodec, and nothing
# downloads there, so these travel with the working tree (scripts/gpu_suite.sh installs them).
#
# PyNvVideoCodec 2.2.4's wheel (26.9 MB) is trimmed here to what decoding needs: its FFmpeg source
# tarball, samples, benchmarks, the CUDA-12.1 build of the module (the image's CUDA 13 driver loads
# the _130 one) and the duplicate copies of libavformat/libavutil under their unversioned and full
# version names go; RECORD is rewritten. faiss, redis and fastapi/pydantic are not needed: no
# GPU-marked test or GPU benchmark imports them.
#
# Prints the size of .whl/ plus the tracked working tree and fails when it exceeds 64 MiB (the most a
# GPU run may carry).   usage: bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHL=.whl
LIMIT=$((64 * 1024 * 1024))
PKGS=("av==18.1.0" "zstandard==0.25.0" "PyNvVideoCodec==2.2.4")
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$WHL"

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$TMP" "${PKGS[@]}"

"$PY" - "$TMP" "$WHL" <<'EOF'
"""Copy the wheels into .whl/, trimming PyNvVideoCodec's to what decoding needs (RECORD rewritten)."""
import base64
import hashlib
import re
import shutil
import sys
import zipfile
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for old in dst.glob("*.whl"):
    old.unlink()
DROP = [
    r"^[^/]+\.data/data/external/ffmpeg/",  # FFmpeg source tarball (12 MB)
    r"^samples/", r"^benchmarks/",  # notebooks, pictures and scripts
    r"^PyNvVideoCodec/PyNvVideoCodec_121\.",  # CUDA 12.1 build: the image's CUDA 13 driver takes _130
    r"^PyNvVideoCodec/lib(avformat|avutil)\.so$",  # duplicates of the SONAME files .so.63 / .so.61
    r"^PyNvVideoCodec/lib(avformat|avutil)\.so\.\d+\.\d+\.\d+$",
]
for whl in sorted(src.glob("*.whl")):
    if not whl.name.lower().startswith("pynvvideocodec-"):
        shutil.copy2(whl, dst / whl.name)
        continue
    out = dst / whl.name
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows, dropped = [], 0
        for info in zin.infolist():
            name = info.filename
            if name == record:
                continue
            if any(re.search(p, name) for p in DROP):
                dropped += info.compress_size
                continue
            data = zin.read(name)
            zout.writestr(info, data)
            if not name.endswith("/"):
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{name},sha256={digest},{len(data)}")
        rows.append(f"{record},,")
        zout.writestr(record, "\n".join(rows) + "\n")
    print(f"trimmed {whl.name}: {whl.stat().st_size / 1e6:.1f} MB -> {out.stat().st_size / 1e6:.1f} MB "
          f"(dropped {dropped / 1e6:.1f} MB compressed)")
EOF

"$PY" - "$WHL" "$LIMIT" <<'EOF'
"""Print .whl/ + tracked (and untracked, not ignored) working-tree bytes; exit 1 above the limit."""
import json
import subprocess
import sys
from pathlib import Path

whl, limit = Path(sys.argv[1]), int(sys.argv[2])
wheels = {p.name: p.stat().st_size for p in sorted(whl.glob("*.whl"))}
files = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True
).stdout.split(b"\0")
tree = sum(Path(f.decode()).stat().st_size for f in files if f and Path(f.decode()).is_file())
total = sum(wheels.values()) + tree
for name, size in wheels.items():
    print(f"  {size / 2**20:7.2f} MiB  .whl/{name}")
print(f"  {tree / 2**20:7.2f} MiB  working tree (tracked + untracked, not ignored)")
print(f"  {total / 2**20:7.2f} MiB  total (limit {limit / 2**20:.0f} MiB)")
print(json.dumps({"wheels_bytes": sum(wheels.values()), "tree_bytes": tree, "total_bytes": total,
                  "limit_bytes": limit, "ok": total <= limit}))
sys.exit(0 if total <= limit else 1)
EOF
