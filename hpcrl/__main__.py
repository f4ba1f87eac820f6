from hpcrl.login.cli import main

raise SystemExit(main())
