set -x
timeout 480 python3 -m bench.sizes --shape 8b --tokens 131072 --reps 2 --dir /tmp/sz 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/sz
