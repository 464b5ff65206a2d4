from qkv.apps.cli import main

raise SystemExit(main())
