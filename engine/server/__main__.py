import sys

from engine.server.core import main

sys.exit(main())
