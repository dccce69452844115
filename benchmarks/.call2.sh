source tests/gpu/device_prepare.sh >/dev/null
out=$OUT
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
bash benchmarks/gpu_int4.sh sweep
if [ -n "$NCU" ]; then
  for cfg in "{}" "{'zsub': True}"; do
    for layer in gate_up qkv; do
      timeout 100 $NCU --kernel-name qgemv_mma --launch-skip 4 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats python benchmarks/qgemv_mma.py --once 1 $layer --config "$cfg" > "$out/ncu-$layer-${#cfg}.log" 2>&1
      echo "ncu $layer $cfg rc=$?"
    done
  done
fi
