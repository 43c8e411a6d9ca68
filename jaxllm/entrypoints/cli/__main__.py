import sys

from jaxllm.entrypoints.cli import main

sys.exit(main())
