#!/usr/bin/env bash
# Runs `libra run CONFIG` on one or many Ascend hosts: launch_cuda.sh with the ascend backend (its
# plugin sets ASCEND_RT_VISIBLE_DEVICES and HCCL for each worker).
#   bash scripts/launch_ascend.sh CONFIG RUN_DIR [section.field=value ...]
BACKEND=ascend exec bash "$(dirname "$0")/launch_cuda.sh" "$@"
