timeout 590 python3 -m bench.restore --size 8b --models-dir /tmp/models --tokens 65536,131072 --dir /tmp/r4 2>&1 | grep "^|"
