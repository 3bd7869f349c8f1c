import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("tiered_kv.restore").setLevel(logging.DEBUG)
from bench.restore import main
sys.exit(main(sys.argv[1:]))
