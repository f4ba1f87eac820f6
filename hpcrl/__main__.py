from hpcrl.cli import main

raise SystemExit(main())
