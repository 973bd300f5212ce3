/*
 * kvlab-solutions: JupyterLab keeps a chapter's worked solutions collapsed, outputs included,
 * when its cells run.
 *
 * A solution cell (tag `hide-cell` or `solution`) is stored collapsed: `jupyter.source_hidden`
 * and `jupyter.outputs_hidden` (tools/execute_notebook.py; the server's contents manager does
 * the same for a chapter's .md). JupyterLab shows every output of a cell it executes
 * (`CodeCell.execute` sets `outputHidden = false`, which also clears `outputs_hidden` in the
 * saved notebook), so Run All put each answer under its exercise and a save dropped the setting.
 * This plugin hides a solution's outputs again as its execution starts and as it ends, while
 * the solution itself is still collapsed: a reader who opened a solution sees what it prints.
 *
 * The file is a JupyterLab prebuilt extension written by hand: a module-federation container
 * (`init` receives the page's share scope, `get('./extension')` returns the plugin module), the
 * interface JupyterLab's bootstrap loads a `jupyter labextension build` output through. It uses
 * one shared module, @jupyterlab/notebook, from JupyterLab itself (its `NotebookActions`
 * signals), so it needs no build step. `.jupyter/jupyter_server_config.py` adds this folder's
 * parent to the server's extension path; tools/lab_check.py checks it in a real browser.
 */
(function () {
  'use strict';

  const NAME = 'kvlab-solutions';
  const SOLUTION_TAGS = ['hide-cell', 'solution'];
  let shareScope = null;

  /** The module `name` as JupyterLab itself provides it (one version: core packages are
   * singletons). */
  async function shared(name) {
    const versions = (shareScope && shareScope[name]) || {};
    const entry = Object.values(versions)[0];
    if (!entry) {
      throw new Error(`${NAME}: JupyterLab shares no ${name}`);
    }
    const factory = await entry.get();
    return typeof factory === 'function' ? factory() : factory;
  }

  function isCollapsedSolution(cell) {
    if (!cell || cell.isDisposed || !cell.model || cell.model.type !== 'code') {
      return false;
    }
    const tags = cell.model.getMetadata('tags') || [];
    return cell.inputHidden && tags.some(tag => SOLUTION_TAGS.includes(tag));
  }

  function keepCollapsed(cell) {
    if (isCollapsedSolution(cell) && !cell.outputHidden) {
      cell.outputHidden = true; // also writes jupyter.outputs_hidden back (syncCollapse)
    }
  }

  const plugin = {
    id: `${NAME}:plugin`,
    description: 'Keeps unopened worked solutions collapsed, outputs included, when cells run.',
    autoStart: true,
    activate: async () => {
      const { NotebookActions } = await shared('@jupyterlab/notebook');
      // `executionScheduled` is emitted just before `CodeCell.execute` shows the outputs, in
      // the same task: a microtask hides them again before any output arrives.
      NotebookActions.executionScheduled.connect((_, { cell }) =>
        queueMicrotask(() => keepCollapsed(cell))
      );
      NotebookActions.executed.connect((_, { cell }) => keepCollapsed(cell));
    }
  };

  const modules = { './extension': { __esModule: true, default: plugin } };
  const lab = (window._JUPYTERLAB = window._JUPYTERLAB || {});
  lab[NAME] = {
    init: scope => {
      shareScope = scope;
    },
    get: module =>
      module in modules
        ? Promise.resolve(() => modules[module])
        : Promise.reject(new Error(`${NAME} has no module ${module}`))
  };
})();
