#!/bin/bash
# alternating old/new `sluice bench io` (cold decode against the I/O roofline), 7 pairs
PY=python
out=./io_ab.jsonl; : > $out
for i in 1 2 3 4 5 6 7; do
  for arm in old new; do
    if [ $arm = old ]; then src=OLD/src; else src=NEW/src; fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    PYTHONPATH=$src $PY -c "import sys; from sluice.cli import main; sys.exit(main(sys.argv[1:]))" bench io MODEL --memory 1GiB --max-context 256 --tokens 12 --threads 1 --json --no-progress 2>/dev/null > ./one.json
    $PY -c "import json,sys; print(json.dumps({'pair': $i, 'arm': '$arm', 'load': $load, 'r': json.load(open('./one.json'))}))" >> $out
  done
done
