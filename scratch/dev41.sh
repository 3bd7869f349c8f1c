for v in none extract batch both; do V=$v timeout 80 python3 scratch/hot64b.py /tmp/models/tiny-1b 2>&1 | grep -v Warn | grep -E "variant|cold|hot 0|hot 1"; done
