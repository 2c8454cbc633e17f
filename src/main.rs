fn main() {
    for m in flash_attention::methods::all() {
        println!("{}: {}", m.name, m.about);
    }
}
