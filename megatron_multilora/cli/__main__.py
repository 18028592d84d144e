import sys

from megatron_multilora.cli import main

sys.exit(main())
