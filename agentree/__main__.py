import sys

from agentree.commands.cli import main

sys.exit(main())
