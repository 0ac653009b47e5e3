from coordlfs.cli import main

raise SystemExit(main())
