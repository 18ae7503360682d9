#!/usr/bin/env bash
# Prepare the GPU kit's offline folder, on a machine with the package index (run from anywhere):
#   bash bench/gpu/fetch_wheels.sh
# 1. downloads the wheels of bench/gpu/requirements.txt for CPython 3.12 on manylinux x86_64 (binary wheels only, no
#    dependencies: the list is complete) into bench/gpu/offline/wheels;
# 2. copies TRL's anchors (trl_grpo.py, trl_sft.py, trl_dpo.py of ../shared/bench, or of $SHARED) into
#    bench/gpu/offline/anchors: the GPU machine gets the repository's working tree only, and posttrain's
#    bench/sft_step.py and dpo_step.py take their rows from the anchors' make_rows();
# 3. rewrites the wheels over 1 MiB with LZMA zip entries instead of deflate (same files, same RECORD; pip installs
#    them as any wheel): pyarrow's and pandas' compiled libraries shrink by a quarter, and the list fits
#    (requirements.txt says why it must); about 80 s of one core;
# 4. prints the wheels' total size and fails if it is not under 64 MiB (what travels with the tree; the folder is
#    emptied first, so that wheels of an earlier list do not count).
# bench/gpu/offline/ is ignored by git: carry it to the GPU machine with the tree, then run bash bench/gpu/run.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
shared=${SHARED:-$root/../shared/bench}
offline=$here/offline
PY=${PYTHON:-python3}
limit_mib=64

for anchor in trl_grpo.py trl_sft.py trl_dpo.py; do
  if [ ! -f "$shared/$anchor" ]; then
    echo "fetch_wheels.sh: $shared/$anchor is missing: set SHARED to the folder that holds TRL's anchor scripts." >&2
    exit 2
  fi
done
rm -rf "$offline/wheels"  # a fresh folder: wheels of an earlier list would count against the limit
mkdir -p "$offline/wheels" "$offline/anchors"
cp "$shared/trl_grpo.py" "$shared/trl_sft.py" "$shared/trl_dpo.py" "$offline/anchors/"

"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_28_x86_64 \
  -d "$offline/wheels" -r "$here/requirements.txt"

"$PY" "$here/kit.py" --recompress-wheels
"$PY" "$here/kit.py" --check-wheels
