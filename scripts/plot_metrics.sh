#!/usr/bin/env bash
# Draws the training loss and the test top-1 of one or more runs, side by
# side, into one PNG (gnuplot, installed on first use).
#
#   bash scripts/plot_metrics.sh OUT.png RUN...
#
# Each RUN is a run's --path (holding metrics.csv) or a metrics.csv itself;
# it is labelled by its directory name, so runs of different hooks compare at
# a glance:
#   bash scripts/plot_metrics.sh hooks.png logging/none logging/powersgd_fp16
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: bash scripts/plot_metrics.sh OUT.png RUN..." >&2
  exit 2
fi
out="$1"
shift

command -v gnuplot >/dev/null || bash "$(dirname "$0")/install_deps.sh" gnuplot-nox >&2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
loss_plots=() top1_plots=()
i=0
for run in "$@"; do
  csv="$run"
  [ -d "$run" ] && csv="$run/metrics.csv"
  if [ ! -f "$csv" ]; then
    echo "plot_metrics: $csv: no such file (give a run's --path or its metrics.csv)" >&2
    exit 1
  fi
  if [ "$(head -n 1 "$csv" | cut -d, -f1-5)" != "epoch,step,split,loss,top1" ]; then
    echo "plot_metrics: $csv: not a metrics.csv written by mnist_ddp" >&2
    exit 1
  fi
  label="$(basename "$(cd "$(dirname "$csv")" && pwd)")"
  label="${label//\"/}"
  awk -F, '$3 == "train" { print $2, $4 }' "$csv" >"$work/train$i"
  awk -F, '$3 == "test" { print $2, $5 }' "$csv" >"$work/test$i"
  loss_plots+=("'$work/train$i' using 1:2 with lines lw 1.5 title \"$label\"")
  top1_plots+=("'$work/test$i' using 1:2 with linespoints lw 1.5 pt 7 title \"$label\"")
  i=$((i + 1))
done

join() { local IFS=','; echo "$*"; }
gnuplot <<EOF
set terminal pngcairo noenhanced size 1400,560 font ",11"
set output "$out"
set multiplot layout 1,2
set grid
set key top right
set xlabel "training step"
set ylabel "training loss (averaged over ranks)"
set title "Training loss"
plot $(join "${loss_plots[@]}")
set key bottom right
set ylabel "test top-1 (%)"
set title "Test accuracy"
plot $(join "${top1_plots[@]}")
unset multiplot
EOF
echo "plot_metrics: wrote $out"
