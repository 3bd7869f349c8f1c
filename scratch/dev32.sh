python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 400 python3 -m bench.restore --size 1b --models-dir /tmp/models --tokens 8192,32768 --repeats 5 --dir /tmp/r5 2>&1 | grep "^|"
