import sys

from fgpu_cli.main import main

sys.exit(main())
