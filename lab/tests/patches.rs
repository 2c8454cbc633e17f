//! The lab's patches to the steps' sources (`lab/patches/`) apply to main as it is: a patch
//! that a change of the step broke fails here, on the CPU, not at the start of a device call.

use std::path::Path;
use std::process::Command;

#[test]
fn every_patch_of_the_lab_applies_to_main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("lab/patches");
    let mut checked = 0;
    for entry in
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
    {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "patch") {
            let out = Command::new("git")
                .args(["apply", "--check"])
                .arg(&path)
                .current_dir(&root)
                .output()
                .expect("running git, which checks the lab's patches");
            assert!(
                out.status.success(),
                "{} no longer applies to main: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no .patch file in {}", dir.display());
}
