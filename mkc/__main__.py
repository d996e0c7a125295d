from mkc.cli import main

raise SystemExit(main())
