"""The settings of a run, as the user gives them: the ELSA settings model (``config``) and its cross-checks, the job
options every entry point shares (``options``), the config files a run reads them from (``config_files``), the
defaults rule that fills what the user left out (``defaults``), and the command-line flags generated from the models
(``flags``). Plain data and validation: nothing here loads weights, starts a process group or sizes a machine."""
