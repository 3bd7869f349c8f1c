timeout 570 python3 -m bench.restore --size 8b --models-dir /tmp/models --tokens 8192,32768 --pages warm --repeats 5 --dir /tmp/r2 2>&1 | grep "^|"
