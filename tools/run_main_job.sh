#!/usr/bin/env bash
# The main job: a 2-rank CPU A/B of EP overlap on a small MoE GPT. Over an emulated 0.2 Gbit/s link when this
# user can create network namespaces (root + iproute2), else over loopback (where comm is small).
set -euo pipefail
mkdir -p out
link=()
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null; then
    link=(--link_gbps 0.2)
else
    echo "note: not root or no iproute2; running over loopback, where all-to-all is cheap and overlap gains little"
fi
exec .venv/bin/python scripts/performance/ep_overlap_ab.py --ab --predict --device cpu "${link[@]}" \
    --json out/ab.json --timeline out/timeline.png "$@"
